"""Formats with one scale per token and KV head (FP8, INT8): each slot's bytes depend on that token alone, so
writes, prefix sharing, copy-on-write and preemption need nothing beyond copying the scales with the elements."""
from __future__ import annotations

import torch

from kvserve.kv.kv_cache import PagedKVCache

SCALE_DTYPE = torch.bfloat16  # float32 range, so tiny vectors keep their scale; 2 bytes
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny  # a zero vector gets this scale, not 0 (which would divide by zero)


class PerTokenQuantizedKVCache(PagedKVCache):
    """Elements in a 1-byte `storage_dtype`, scales [layers, slots, kv_heads] in bfloat16 beside them."""

    storage_dtype: torch.dtype
    exact = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shape = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
        self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)

    def describe(self) -> str:
        return f"{self.format_name}, per-token-head scales"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, heads, dim] -> stored elements and [T, heads] scales."""
        raise NotImplementedError

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Stored elements [..., heads, dim] and their scales [..., heads] -> values in the compute dtype."""
        raise NotImplementedError

    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for data, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = self.quantize(x)
            data[row].index_copy_(0, slot_mapping, q)
            scales[row].index_copy_(0, slot_mapping, scale)

    def _gather(self, row: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = block_tables.reshape(-1)
        lead = (*block_tables.shape[:-1], block_tables.shape[-1] * self.block_size)
        out = []
        for data, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = self._blocks_view(data, row).index_select(0, flat)
            scale = self._blocks_view(scales, row).index_select(0, flat)
            out.append(self.dequantize(q, scale).view(*lead, self.num_kv_heads, self.head_dim))
        return out[0], out[1]

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.v_scale]


def absmax_scale(x: torch.Tensor, max_code: float) -> torch.Tensor:
    """Per [T, heads] vector: amax / max_code, rounded to the scale dtype (the stored value is the one used)."""
    amax = x.abs().amax(dim=-1).float()
    return (amax / max_code).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
