"""Formats with one scale per token and KV head (FP8, INT8): each slot's bytes depend on that token alone, so
writes, prefix sharing, copy-on-write and preemption need nothing beyond copying the scales with the elements."""
from __future__ import annotations

import functools

import torch

from kvserve.kv.formats.compiled import CompiledFunction, attend, warm_up_decode
from kvserve.kv.kv_cache import PagedKVCache

SCALE_DTYPE = torch.bfloat16  # float32 range, so tiny vectors keep their scale; 2 bytes
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny  # a zero vector gets this scale, not 0 (which would divide by zero)


class PerTokenQuantizedKVCache(PagedKVCache):
    """Elements in a 1-byte `storage_dtype`, scales [layers, slots, kv_heads] in bfloat16 beside them."""

    storage_dtype: torch.dtype
    element_dtype: torch.dtype  # what the stored bytes are (storage_dtype, or float8 kept as uint8)
    compiled_decode_pays = True  # whether compiling decode attention (formats.compiled) measured faster
    exact = False

    def __init__(self, *args, compile: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_decode = (fused_decode_attention(self.block_size, self.element_dtype)
                             if compile and self.compiled_decode_pays else None)
        shape = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
        self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)

    def describe(self) -> str:
        if not self.compiled_decode_pays:
            return f"{self.format_name}, per-token-head scales"
        decode = "eager" if self.fused_decode is None or self.fused_decode.failed else "compiled"
        return f"{self.format_name}, per-token-head scales; {decode} decode attention"

    def warm_up(self, num_query_heads: int) -> None:
        if self.fused_decode is not None:
            warm_up_decode(self, self.fused_decode, num_query_heads, extra_keys=0)

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        """Over the stored blocks alone: the new token was written, and is read back, like every other."""
        N = self.num_blocks
        q = queries if self.rotation is None else queries @ self.rotation
        args = (q, self.k[row].view(N, -1), self.k_scale[row].view(N, -1), self.v[row].view(N, -1),
                self.v_scale[row].view(N, -1), block_tables, mask)
        dynamic = [(t, 0) for t in args] + [(block_tables, 1), (mask, 3)]
        out = self.fused_decode(args, dynamic)
        return out if out is None or self.rotation is None else out @ self.rotation.T

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
            q = self._select_blocks(data, row, flat).view(*lead, self.num_kv_heads, self.head_dim)
            scale = self._select_blocks(scales, row, flat).view(*lead, self.num_kv_heads)
            out.append(self.dequantize(q, scale))
        return out[0], out[1]

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.v_scale]


def absmax_scale(x: torch.Tensor, max_code: float) -> torch.Tensor:
    """Per [T, heads] vector: amax / max_code, rounded to the scale dtype (the stored value is the one used)."""
    amax = x.abs().amax(dim=-1).float()
    return (amax / max_code).clamp(min=MIN_SCALE).to(SCALE_DTYPE)


@functools.cache
def fused_decode_attention(block_size: int, element_dtype: torch.dtype) -> CompiledFunction:
    """Decode attention over the stored elements (see formats.compiled): selecting, widening and scaling them and
    attending become a few generated loops. One per block size and element type."""
    def dequantize(data: torch.Tensor, scale: torch.Tensor, block_tables: torch.Tensor, heads: int,
                   dim: int) -> torch.Tensor:
        S, B = block_tables.shape
        n, blocks = S * B, block_tables.reshape(-1)
        x = data.index_select(0, blocks).view(element_dtype).float().view(n, block_size, heads, dim)
        x = x * scale.index_select(0, blocks).float().view(n, block_size, heads, 1)
        return x.view(S, B * block_size, heads, dim)

    def per_token_decode_attention(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor,
                                   v_data: torch.Tensor, v_scale: torch.Tensor, block_tables: torch.Tensor,
                                   mask: torch.Tensor) -> torch.Tensor:
        H, D = q.shape[1], q.shape[3]
        keys = dequantize(k_data, k_scale, block_tables, H, D)
        return attend(q, keys, dequantize(v_data, v_scale, block_tables, H, D), mask)

    return CompiledFunction(per_token_decode_attention)
