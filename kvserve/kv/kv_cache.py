"""Where K and V live: preallocated storage for all layers, addressed by slot = block * block_size + offset.

`PagedKVCache` is the interface every storage format implements: write new tokens into slots, gather a batch's
context for attention (in the model's compute dtype), copy blocks for copy-on-write. The full-precision format
is here; the quantized ones are in kvserve/kv/formats/."""
from __future__ import annotations

import torch


class PagedKVCache:
    """Storage for `num_layers` layers of `num_blocks` blocks; subclasses decide how an element is stored."""

    format_name = "?"
    exact = True  # reads return exactly what was written (no rounding): attention may use fresh K/V instead
    exact_own_block = False  # a query sees its own, still-filling block in full precision (see formats.int4)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what gather returns: the model's compute dtype
        self.device = device

    @property
    def nbytes(self) -> int:
        """Bytes of the block storage (what the planner predicts); see `extra_nbytes` for the rest."""
        return sum(t.nbytes for t in self._block_tensors())

    @property
    def extra_nbytes(self) -> int:
        """Bytes held outside the blocks (a format's full-precision staging); 0 for most formats."""
        return 0

    def describe(self) -> str:
        """The format as the start-up line names it."""
        return self.format_name

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of the step's new tokens ([T, kv_heads, head_dim]) at their slots ([T])."""
        raise NotImplementedError

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks ([S, B] block ids) as [S, B * block_size, kv_heads, head_dim] each."""
        raise NotImplementedError

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, everything a block holds included."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for tensor in self._block_tensors():
            blocks = tensor.view(tensor.shape[0], self.num_blocks, -1, *tensor.shape[2:])
            blocks[:, dst] = blocks[:, src]

    def begin_step(self, freed_blocks: list[int], copies: list[tuple[int, int]], slot_mapping: torch.Tensor) -> None:
        """Once per step, before the layers run: blocks freed since the last step (their contents are gone),
        copy-on-write copies to make, and the slots this step's tokens will be written to."""
        self.copy_blocks(copies)

    def _block_tensors(self) -> list[torch.Tensor]:
        """Every tensor shaped [layers, num_blocks * k, ...] that holds block contents (k per-block rows)."""
        raise NotImplementedError

    def _blocks_view(self, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        return tensor[layer].view(self.num_blocks, -1, *tensor.shape[2:])


class FullPrecisionKVCache(PagedKVCache):
    """K and V as plain floats (float32, bfloat16 or float16): one tensor each, [layers, slots, heads, head_dim]."""

    def __init__(self, *args, storage_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.storage_dtype = storage_dtype or self.dtype
        self.format_name = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                            torch.float16: "float16"}[self.storage_dtype]
        self.exact = self.storage_dtype == self.dtype
        shape = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        # zeros, not empty: padded and masked key slots are still multiplied (by 0) in attention, and
        # uninitialised memory may hold NaN, which 0 * NaN would spread into real outputs
        self.k = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slot_mapping, k.to(self.storage_dtype))
        self.v[layer].index_copy_(0, slot_mapping, v.to(self.storage_dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # whole blocks rather than single slots: the same bytes in 16x fewer, larger pieces
        flat = block_tables.reshape(-1)
        shape = (*block_tables.shape[:-1], block_tables.shape[-1] * self.block_size, *self.k.shape[2:])
        k = self._blocks_view(self.k, layer).index_select(0, flat)
        v = self._blocks_view(self.v, layer).index_select(0, flat)
        return k.view(shape).to(self.dtype), v.view(shape).to(self.dtype)

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]
