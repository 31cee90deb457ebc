"""Where K and V live: one preallocated tensor per kind for all layers, addressed by slot = block * block_size + offset.

This is the storage interface quantized formats will replace: write new tokens into slots, gather a batch's
context for attention, copy blocks for copy-on-write."""
from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded and masked key slots are still multiplied (by 0) in attention, and
        # uninitialised memory may hold NaN, which 0 * NaN would spread into real outputs
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of the step's new tokens ([T, kv_heads, head_dim]) at their slots ([T])."""
        self.k[layer].index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks ([S, B] block ids) as [S, B * block_size, kv_heads, head_dim] each.
        Copying whole blocks rather than single slots moves the same bytes in 16x fewer, larger pieces."""
        flat = block_tables.reshape(-1)
        shape = (*block_tables.shape[:-1], block_tables.shape[-1] * self.block_size, *self.k.shape[2:])
        k = self.k[layer].view(self.num_blocks, self.block_size, *self.k.shape[2:]).index_select(0, flat)
        v = self.v[layer].view(self.num_blocks, self.block_size, *self.v.shape[2:]).index_select(0, flat)
        return k.view(shape), v.view(shape)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer."""
        if not pairs:
            return
        offsets = torch.arange(self.block_size, device=self.k.device)
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)[:, None] * self.block_size + offsets
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)[:, None] * self.block_size + offsets
        for cache in (self.k, self.v):
            cache[:, dst.reshape(-1)] = cache[:, src.reshape(-1)]
