"""Where K and V live: preallocated storage for all layers, addressed by slot = block * block_size + offset.

`PagedKVCache` is the interface every storage format implements: once per step, learn where this step's tokens
go (begin_step); per layer, write the new tokens and gather a batch's context for attention (in the model's
compute dtype); copy blocks for copy-on-write. Each cache holds the reader attention reads it with (`reader`,
kv/readers.py), chosen once when it is built. Blocks follow the model's KVLayout: a block holds block_size
tokens of the `layers_per_block` layers of one layer group, and each group has its own slots for a token. The
full-precision format is here; the quantized ones are in kvserve/kv/formats/."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvserve.batch_invariant import RowTiles
from kvserve.kv.readers import AttentionReader, DecodeKernelReader, GatherReader, TileReader
from kvserve.planner.layout import KVLayout


class PagedKVCache:
    """Storage for `num_blocks` blocks of one layout's rows; subclasses decide how an element is stored."""

    format_name = "?"
    exact = True  # reads return exactly what was written (no rounding): attention may use fresh K/V instead
    exact_own_block = False  # a query sees its own, still-filling block in full precision (see formats.int4)
    # When set ([head_dim, head_dim], orthonormal), gather returns K and V as stored: multiplied by it on the right.
    # Attention then multiplies queries by it too and its output by its transpose (formats.fp8 explains why).
    rotation: torch.Tensor | None = None
    fused_decode = None  # a formats.compiled.CompiledFunction: see decode_attention and attend_decodes_with

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", tiles: RowTiles | None = None):
        self.layout = layout
        self.num_layers = layout.layers_per_block  # storage rows: one per layer of a group
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what gather returns: the model's compute dtype
        self.device = device
        self.tiles = tiles or RowTiles()  # how a format cuts per-token work on write (batch-invariant mode: tiles)
        # how attention reads this cache: batch-invariant mode's tiles, else gathered blocks (attend_decodes_with)
        self.reader: AttentionReader = TileReader(self) if self.tiles else GatherReader(self)

    def attend_decodes_with(self, kernel: Callable[..., torch.Tensor | None] | None) -> None:
        """A format's compiled decode attention (formats.compiled.CompiledFunction, or None: none), which then
        reads its decodes (DecodeKernelReader) unless tiles read every query alike (batch-invariant mode)."""
        self.fused_decode = kernel
        if kernel is not None and not self.tiles:
            self.reader = DecodeKernelReader(self)

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

    def compiled_kernels(self) -> dict:
        """The format's compiled kernels (formats.compiled.CompiledFunction) by what they do, for the start-up line."""
        return {} if self.fused_decode is None else {"decode attention": self.fused_decode}

    def warm_up(self, num_query_heads: int) -> None:
        """Prepare attention before the first step, for a model with `num_query_heads` query heads (a format that
        compiles its decode attention compiles it here)."""

    def max_draft_tokens(self, position: int) -> int | None:
        """How many speculative tokens may follow the token at `position` in one step, to be written again if they
        are rejected (engine/speculative.py); None: any number. Formats whose slots hold each token alone allow
        any; one that finalizes a block's bytes when the block fills (int4) keeps drafts out of a block's last slot."""
        return None

    def begin_step(self, freed_blocks: list[int], copies: list[tuple[int, int]],
                   slot_mappings: Sequence[torch.Tensor]) -> None:
        """Once per step, before the layers run: blocks freed since the last step (their contents are gone),
        copy-on-write copies to make, and for each layer group the slots this step's tokens go to ([T] each)."""
        self.copy_blocks(copies)
        self._slot_mappings = list(slot_mappings)

    def rewind_step(self) -> None:
        """Before running the last step again over the same slots (`kvserve bench step` replays one): what the
        cache would drop at the next step because of that step is kept. Nothing, for a format that stores each token
        as it is written."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of the step's new tokens ([T, kv_heads, head_dim]) for `layer` at its group's slots."""
        group = self.layout.group_of[layer]
        self._write(self.layout.row_of[layer], group, self._slot_mappings[group], k, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks of `layer`'s group ([S, B] block ids) as [S, B * block_size, kv_heads, head_dim]."""
        return self._gather(self.layout.row_of[layer], block_tables)

    def gather_with_own_block(self, layer: int, block_tables: torch.Tensor, own_blocks: torch.Tensor,
                              new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Formats with `exact_own_block`: gather's blocks, then each request's own block's staged full-precision
        tokens ([S] block ids, -1: none), then the chunk's new tokens `new_k`/`new_v` ([S, Q, kv_heads, head_dim])."""
        raise NotImplementedError(f"{self.format_name} KV cache reads every block quantized (exact_own_block=False)")

    def decode_reads_in_place(self) -> bool:
        """Whether decode attention reads each request's blocks where they lie, nothing padded (see
        AttentionReader.reads_decodes_in_place)."""
        return False

    def decode_attention(self, layer: int, queries: torch.Tensor, block_tables: torch.Tensor,
                         own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor | None:
        """A format with a compiled decode attention (`fused_decode`, kv/formats/compiled.py) attends over its
        stored form itself, for one query per request: queries [S, kv_heads, heads per kv head, head_dim];
        block_tables, own_blocks (int4), new_k and new_v as gather_with_own_block's; mask [S, 1, 1, keys]. Returns
        [S, kv_heads, heads per kv head, head_dim], or None (no such attention, or it failed to compile): gather,
        then attend."""
        if self.fused_decode is None:
            return None
        return self._decode_attention(self.layout.row_of[layer], queries * scale, block_tables, own_blocks, new_k,
                                      new_v, mask)

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        """decode_attention for storage row `row`, queries already multiplied by the softmax scale."""
        raise NotImplementedError

    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _gather(self, row: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, everything a block holds included."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for tensor in self._block_tensors():
            blocks = self._per_block(tensor)
            blocks[:, dst] = blocks[:, src]

    def export_block(self, block_id: int) -> list[torch.Tensor]:
        """A copy of everything one block holds, every layer of its group (one tensor per `_block_tensors` entry):
        what a lower tier stores. A full block's contents are all here (int4 stages only partly filled blocks)."""
        copies = []
        for tensor in self._block_tensors():
            rows = self._per_block(tensor)[:, block_id]
            copies.append(torch.empty(rows.shape, dtype=rows.dtype, device=rows.device))
            copy_rows(copies[-1], rows)
        return copies

    def import_block(self, block_id: int, tensors: Sequence[torch.Tensor]) -> None:
        """Put back what `export_block` returned (from any block of a cache of this format and shape)."""
        for tensor, saved in zip(self._block_tensors(), tensors, strict=True):
            copy_rows(self._per_block(tensor)[:, block_id], saved.to(self.device))

    def block_specs(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Dtype and shape of each tensor `export_block` returns: what a stored block must match to be imported."""
        return [(t.dtype, tuple(self._per_block(t)[:, 0].shape)) for t in self._block_tensors()]

    def _per_block(self, tensor: torch.Tensor) -> torch.Tensor:
        """A block tensor viewed as [layers, num_blocks, rows per block, ...]."""
        return tensor.view(tensor.shape[0], self.num_blocks, -1, *tensor.shape[2:])

    def _block_tensors(self) -> list[torch.Tensor]:
        """Every tensor shaped [layers, num_blocks * k, ...] that holds block contents (k per-block rows)."""
        raise NotImplementedError

    def _blocks_view(self, tensor: torch.Tensor, row: int) -> torch.Tensor:
        return tensor[row].view(self.num_blocks, -1, *tensor.shape[2:])

    def _select_blocks(self, tensor: torch.Tensor, row: int, blocks: torch.Tensor) -> torch.Tensor:
        """The contents of `blocks` ([n] ids) in one storage row of `tensor`, one flat row per block: [n, elements].
        Rows of this 2-D view are selected faster than those of the [blocks, ...] view when they are small (scales,
        codes), and as fast when they are large."""
        return tensor[row].view(self.num_blocks, -1).index_select(0, blocks)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, one block's rows in every layer. On a CPU through numpy, on one thread: torch splits a copy
    this size over its threads, and on a busy machine waits for a descheduled one (28 MB/s instead of 3.7 GB/s
    for SmolLM2's float32 blocks on the 2-core development box)."""
    if not dst.is_cpu:
        dst.copy_(src)
        return
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dst.element_size()]
    dst.view(raw).numpy()[...] = src.view(raw).numpy()


class LayerRow:
    """One layer's row of a cache as the cache of a one-group step, the row a tensor: what the whole compiled graph's
    layer region (model/attention.py, run_layer) writes to and reads from, so that one traced layer serves all
    (Dynamo reuses a region only for tensor inputs: an int row would be baked into it). It writes and gathers as
    the cache does for that row, at the step's slots of that layer's group, and is read by gathering (GatherReader:
    the whole graph attends one query per request inside itself)."""

    def __init__(self, cache: PagedKVCache, row: torch.Tensor, slot_mapping: torch.Tensor):
        self.cache, self.row, self.slot_mapping = cache, row, slot_mapping
        self.rotation = cache.rotation
        self.reader = GatherReader(self)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache._write(self.row, 0, self.slot_mapping, k, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache._gather(self.row, block_tables)


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
        # Writes and reads go through these views of the same storage: every layer's slots one after another, one
        # row per slot. In the compiled decode step (compile/steps.py) the pool is then a graph input that
        # the graph writes to directly, which Inductor does in place; written through a view made inside the graph
        # (self.k[row]), it would copy the whole pool at every step (1 GiB for SmolLM2's default pool).
        self._k_slots = self.k.view(-1, *shape[2:])
        self._v_slots = self.v.view(-1, *shape[2:])
        self._slots_per_row = self.num_blocks * self.block_size

    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = slot_mapping + row * self._slots_per_row
        self._k_slots.index_copy_(0, slots, k.to(self.storage_dtype))
        self._v_slots.index_copy_(0, slots, v.to(self.storage_dtype))

    def _gather(self, row: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # whole blocks rather than single slots: the same bytes in 16x fewer, larger pieces. Selected as [blocks,
        # block_size, slot elements], not [blocks, all elements]: in a compiled graph Inductor then reads each slot's
        # elements as one vectorized run; from the flat rows it computed every element's source with a division and
        # a modulo, one element at a time (docs/benchmarks.md, "The compiled gather")
        blocks = block_tables.reshape(-1) + row * self.num_blocks
        shape = (*block_tables.shape[:-1], block_tables.shape[-1] * self.block_size, *self._k_slots.shape[1:])
        per_block = (self.num_layers * self.num_blocks, self.block_size, -1)
        k = self._k_slots.view(per_block).index_select(0, blocks)
        v = self._v_slots.view(per_block).index_select(0, blocks)
        return k.view(shape).to(self.dtype), v.view(shape).to(self.dtype)

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]
