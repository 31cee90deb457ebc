"""MLA's cache (DeepSeek-V2/V3): per token and layer one vector, the normalized latent (kv_lora_rank values) then
the rotated RoPE key every head shares (qk_rope_head_dim), instead of per-head K and V.

It is a PagedKVCache of one "KV head" of head_dim rank + rope that stores no V: `write` takes the vector as k (v is
None) and `gather` returns it as both (attention reads the latent part as values; model/deepseek.py). Blocks,
slots, copy-on-write, prefix sharing and the disk tier's export/import are every format's. Bytes per token are
layers x (rank + rope) x bytes/element, plus one bfloat16 scale per vector for int8 and fp8: the planner's MLA
figure (planner/kv_size.py). One scale per vector, not per part: the latent is RMS-normalized and the rope key
is not, so a rope key far larger than the latent sets the scale of both (docs/quality.md measures the cost)."""
from __future__ import annotations

import torch

from kvserve.kv.formats.per_token import SCALE_DTYPE, absmax_scale
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.planner.kv_size import latent_words

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LATENT_FORMATS = (*FLOAT_DTYPES, "int8", *FP8_DTYPES)
INT8_MAX = 127


def check_latent_settings(format_name: str, eviction: str) -> None:
    """Refuse, before anything loads, the KV settings an MLA model cannot run with."""
    if format_name not in LATENT_FORMATS:
        raise ValueError(f"kv_cache_dtype={format_name!r} is not supported for MLA models; use auto, "
                         f"{', '.join(LATENT_FORMATS)}")
    if eviction == "h2o":  # its scores come from a written-out attention path MLA does not have
        raise ValueError("kv_eviction='h2o' is not supported for MLA models; use none or streaming")


class LatentKVCache(PagedKVCache):
    """The latent vectors [layers, slots, 1, rank + rope] in a float dtype, int8 or fp8 (these with scales
    [layers, slots, 1])."""

    def __init__(self, *args, format_name: str, rope_dim: int, **kwargs):
        super().__init__(*args, **kwargs)
        check_latent_settings(format_name, "none")
        self.format_name = format_name
        self.rank, self.rope_dim = self.head_dim - rope_dim, rope_dim
        self.element_dtype = FLOAT_DTYPES.get(format_name) or FP8_DTYPES.get(format_name) or torch.int8
        self.exact = self.element_dtype == self.dtype
        shape = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        # fp8 kept as raw bytes: CPU indexing kernels do not take float8 types; zeros, not empty: masked keys are
        # still multiplied (by 0) in attention, and 0 * NaN from uninitialised memory would spread
        stored = torch.uint8 if format_name in FP8_DTYPES else self.element_dtype
        self.vectors = torch.zeros(shape, dtype=stored, device=self.device)
        quantized = format_name not in FLOAT_DTYPES
        self.scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device) if quantized else None

    def describe(self) -> str:
        scales = ", one scale per token and layer" if self.scales is not None else ""
        return f"{self.format_name}{scales}; {latent_words(self.rank, self.rope_dim)}"

    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: None) -> None:
        if self.scales is None:
            self.vectors[row].index_copy_(0, slot_mapping, k.to(self.element_dtype))
            return
        codes, scale = self._quantize(k)
        self.vectors[row].index_copy_(0, slot_mapping, codes)
        self.scales[row].index_copy_(0, slot_mapping, scale)

    def _gather(self, row: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = block_tables.reshape(-1)
        shape = (*block_tables.shape[:-1], block_tables.shape[-1] * self.block_size, *self.vectors.shape[2:])
        vectors = self._select_blocks(self.vectors, row, flat).view(shape)
        if self.scales is None:
            vectors = vectors.to(self.dtype)
        else:
            vectors = self._dequantize(vectors, self._select_blocks(self.scales, row, flat).view(shape[:-1]))
        return vectors, vectors

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, dim] -> codes and [T, 1] scales (absmax / the format's largest code)."""
        if self.element_dtype == torch.int8:
            scale = absmax_scale(x, INT8_MAX)
            return (x.float() / scale.float()[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
        fp8_max = torch.finfo(self.element_dtype).max
        scale = absmax_scale(x, fp8_max)
        scaled = (x.float() / scale.float()[..., None]).clamp_(-fp8_max, fp8_max)
        return scaled.to(self.element_dtype).view(torch.uint8), scale

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        values = codes.float() if self.element_dtype == torch.int8 else codes.view(self.element_dtype).float()
        return values.mul_(scale.float()[..., None]).to(self.dtype)

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.vectors] if self.scales is None else [self.vectors, self.scales]
