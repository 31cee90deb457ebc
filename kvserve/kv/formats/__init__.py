"""KV cache storage formats by canonical name (EngineConfig.kv_cache_format), and the factory the engine calls with
one KVCacheSpec.

Full precision lives in kvserve/kv/kv_cache.py; each quantized format is its own module here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.batch_invariant import RowTiles
from kvserve.kv.formats.flex_decode import InPlaceFloatKVCache
from kvserve.kv.formats.fp8 import Fp8KVCache
from kvserve.kv.formats.int4 import Int4KVCache
from kvserve.kv.formats.int8 import Int8KVCache
from kvserve.kv.formats.latent import LatentKVCache
from kvserve.kv.formats.nonuniform import NONUNIFORM_FORMATS, NonUniformKVCache
from kvserve.kv.kv_cache import FullPrecisionKVCache, PagedKVCache
from kvserve.planner.layout import KVLayout

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class KVCacheSpec:
    """What make_kv_cache builds: `format_name`'s storage for `num_blocks` blocks of `layout`'s rows, read back in
    `dtype` (the model's compute dtype). int4, nuq4 and nuq3 keep one full-precision staging row per partly filled
    block (two per sequence at most), sized for `max_num_seqs` sequences per layer group. int8, int4 and the
    non-uniform formats compile their decode attention unless `compile` is False (formats.compiled); float32 on a
    CPU compiles one that reads the blocks in place when `decode_in_place` is set too (formats.flex_decode: the
    engine sets it with --compile-decode). `tiles`: how writes cut per-token work, and batch-invariant mode's tile reads
    (kvserve/batch_invariant.py). An MLA model caches one latent vector of head_dim values per token and layer, the
    last `latent_rope_dim` its RoPE key (formats.latent)."""

    format_name: str
    layout: KVLayout
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str | torch.device = "cpu"
    max_num_seqs: int = 1
    compile: bool = True
    tiles: RowTiles | None = None
    latent_rope_dim: int | None = None
    decode_in_place: bool = False


def make_kv_cache(spec: KVCacheSpec | str, *args, **kwargs) -> PagedKVCache:
    """The storage `spec` describes, with the reader attention reads it with (kv/readers.py). KVCacheSpec's fields
    in order (the positional and keyword arguments callers passed before the spec) build the spec too."""
    if not isinstance(spec, KVCacheSpec):
        spec = KVCacheSpec(spec, *args, **kwargs)
    blocks = (spec.layout, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    common = dict(dtype=spec.dtype, device=spec.device, tiles=spec.tiles)
    name = spec.format_name
    if spec.latent_rope_dim is not None:
        return LatentKVCache(*blocks, **common, format_name=name, rope_dim=spec.latent_rope_dim)
    if name in FLOAT_FORMATS:
        storage = FLOAT_FORMATS[name]
        if spec.compile and spec.decode_in_place and storage == spec.dtype == torch.float32 and \
                torch.device(spec.device).type == "cpu":
            return InPlaceFloatKVCache(*blocks, **common)
        return FullPrecisionKVCache(*blocks, **common, storage_dtype=storage)
    if name in FP8_FORMATS:
        return Fp8KVCache(*blocks, **common, fp8_dtype=FP8_FORMATS[name])
    if name == "int8":
        return Int8KVCache(*blocks, **common, compile=spec.compile)
    if name == "int4":
        return Int4KVCache(*blocks, **common, max_num_seqs=spec.max_num_seqs * spec.layout.num_groups,
                           compile=spec.compile)
    if name in NONUNIFORM_FORMATS:
        return NonUniformKVCache(*blocks, **common, format_name=name, compile=spec.compile,
                                 max_num_seqs=spec.max_num_seqs * spec.layout.num_groups)
    raise ValueError(f"unknown KV cache format {name!r}")
