"""KV cache storage formats by canonical name (EngineConfig.kv_cache_format), and the factory the engine calls.

Full precision lives in kvserve/kv/kv_cache.py; each quantized format is its own module here."""
from __future__ import annotations

import torch

from kvserve.batch_invariant import RowTiles
from kvserve.kv.formats.flex_decode import InPlaceFloatKVCache
from kvserve.kv.formats.fp8 import Fp8KVCache
from kvserve.kv.formats.int4 import Int4KVCache
from kvserve.kv.formats.int8 import Int8KVCache
from kvserve.kv.formats.latent import LatentKVCache
from kvserve.kv.kv_cache import FullPrecisionKVCache, PagedKVCache
from kvserve.planner.layout import KVLayout

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def make_kv_cache(format_name: str, layout: KVLayout, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                  max_num_seqs: int = 1, compile: bool = True, tiles: RowTiles | None = None,
                  latent_rope_dim: int | None = None, decode_in_place: bool = False) -> PagedKVCache:
    """The storage for `format_name`; `dtype` is the model's compute dtype, which reads return. int4 keeps one
    full-precision staging row per partly filled block (two per sequence at most), sized for `max_num_seqs`
    sequences per layer group. int8 and int4 compile their decode attention unless `compile` is False
    (formats.compiled); float32 on a CPU compiles one that reads the blocks in place when `decode_in_place` is set
    too (formats.flex_decode: the engine sets it with --compile-decode). `tiles`: how writes cut per-token work
    (kvserve/batch_invariant.py). An MLA model caches one latent vector of head_dim values per token and layer,
    the last `latent_rope_dim` its RoPE key (formats.latent)."""
    args = (layout, num_blocks, block_size, num_kv_heads, head_dim)
    common = dict(dtype=dtype, device=device, tiles=tiles)
    if latent_rope_dim is not None:
        return LatentKVCache(*args, **common, format_name=format_name, rope_dim=latent_rope_dim)
    if format_name in FLOAT_FORMATS:
        storage = FLOAT_FORMATS[format_name]
        if compile and decode_in_place and storage == dtype == torch.float32 and torch.device(device).type == "cpu":
            return InPlaceFloatKVCache(*args, **common)
        return FullPrecisionKVCache(*args, **common, storage_dtype=storage)
    if format_name in FP8_FORMATS:
        return Fp8KVCache(*args, **common, fp8_dtype=FP8_FORMATS[format_name])
    if format_name == "int8":
        return Int8KVCache(*args, **common, compile=compile)
    if format_name == "int4":
        return Int4KVCache(*args, **common, max_num_seqs=max_num_seqs * layout.num_groups, compile=compile)
    raise ValueError(f"unknown KV cache format {format_name!r}")
