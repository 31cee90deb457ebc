"""Decode attention over full-precision blocks where they lie in the pool: PyTorch's flex_attention, compiled
(Inductor's C++ flex-attention template on a CPU), told by a block mask which blocks each request reads.

The eager read (kv_cache.FullPrecisionKVCache._gather, then scaled_dot_product_attention) copies every request's
context out of the pool at every layer, padded to the longest of its bucket (model_runner.MIN_BUCKET_FILL), and
the kernel then reads the copy. Here the pool itself is the keys and values ([1, kv_heads, slots, head_dim], a
view of one layer's row), and each request's row of the block mask lists its blocks by their ids in the pool:
those its mask takes whole ("full" blocks: no mask is evaluated there) and at most MAX_PARTIAL_BLOCKS it takes in
part (the block still filling; a sliding window's first), whose keys the mask function reads from the request's
own mask. Nothing is copied and nothing padded, so one call per layer group takes every decode of a step, whatever
their context lengths (the runner stops bucketing them: `PagedKVCache.decode_reads_in_place`), and a request's
result does not depend on the other requests of its batch. A step with more partial blocks than that returns
None: it is read eagerly. Measured against the eager read in docs/benchmarks.md ("Decode attention in place")."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvserve.kv.formats.compiled import CompiledFunction, decode_kind, warm_up_decode
from kvserve.kv.kv_cache import FullPrecisionKVCache

MAX_PARTIAL_BLOCKS = 2  # per request: the block still filling, and a sliding window's first
REORDER_GAIN = 1.1  # reorder a step's requests when the busiest thread's share would shrink by this factor or more


class InPlaceFloatKVCache(FullPrecisionKVCache):
    """float32 K and V (FullPrecisionKVCache) whose decode attention reads them in the pool: make_kv_cache's choice on
    a CPU when asked (`decode_in_place`, the engine's --compile-decode) unless compiling is off. Only the eager
    steps' attention changes: a compiled graph that attends inside itself (a single stream's) keeps its own, the
    gather and attention fused by Inductor."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the cache's own, so a failure (say, no C++ compiler) is this engine's; its graphs are saved whole and kept
        # for the process (kvserve/saved_graphs.py): a later engine of the same block size compiles nothing
        self.attend_decodes_with(flex_decode_attention(self.block_size))
        self._block_masks: dict[tuple[int, int], tuple] = {}  # this step's, by its tables and mask (_decode_attention)

    def describe(self) -> str:
        return f"{super().describe()}; {decode_kind(self.fused_decode)} decode attention in place"

    def warm_up(self, num_query_heads: int) -> None:
        warm_up_decode(self, self.fused_decode, num_query_heads, extra_keys=0, batches=(8,))  # one request: eager
        self._block_masks.clear()  # nothing of the warm-up's kept: a compiled graph's name describes this cache

    def decode_reads_in_place(self) -> bool:
        return self.fused_decode.failed is None

    def begin_step(self, freed_blocks: list[int], copies: list[tuple[int, int]],
                   slot_mappings: Sequence[torch.Tensor]) -> None:
        self._block_masks.clear()
        super().begin_step(freed_blocks, copies, slot_mappings)

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling():  # inside a graph (--compile-gemms' whole graph): the graph's own attention
            return None
        if queries.shape[0] == 1:  # one request failed to compile ("All the buffers in the score and mask subgraph
            return None  # should be in kernel_group.args.input_buffers", torch 2.13): gathered, nothing padded anyway
        key = (id(block_tables), id(mask))  # a step's call builds its block mask once, for all its layers (kept with
        if key not in self._block_masks:  # its tensors, whose ids stay theirs until the next step clears it)
            self._block_masks[key] = (block_tables, mask, self._step_inputs(block_tables, mask, queries.shape[1]))
        order, inputs = self._block_masks[key][2]
        if inputs is None:
            return None
        if order is not None:
            queries = queries.index_select(0, order[0])
        args = (queries, self.k[row], self.v[row], *inputs)
        dynamic = [(t, 0) for t in args] + [(inputs[1], 1), (inputs[3], 1)] if self.fused_decode.warming else ()
        out = self.fused_decode(args, dynamic)
        return out.index_select(0, order[1]) if out is not None and order is not None else out

    def _step_inputs(self, block_tables: torch.Tensor, mask: torch.Tensor, kv_heads: int
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, ...] | None]:
        """A step's block mask inputs, and the order its requests are attended in with its inverse (None: as
        given), balanced over the kernel's threads (module doc)."""
        inputs = block_mask_inputs(block_tables, mask, self.block_size, self.num_blocks)
        if inputs is None:
            return None, None
        blocks = (inputs[0] + inputs[2]).tolist()  # whole and partial blocks each request reads
        order = thread_balanced_order(blocks, kv_heads, torch.get_num_threads())
        if order is None:
            return None, inputs
        order = torch.tensor(order, device=block_tables.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        return (order, inverse), block_mask_inputs(block_tables[order], mask[order], self.block_size, self.num_blocks)


def block_mask_inputs(block_tables: torch.Tensor, mask: torch.Tensor, block_size: int,
                      num_blocks: int) -> tuple[torch.Tensor, ...] | None:
    """The block mask of one decode step's requests, as the tensors `flex_decode_attention` takes: block_tables
    [S, B] block ids, mask [S, 1, 1, B * block_size] (True: that key is read). Returns (full blocks per request
    [S], their ids [S, num_blocks], partial blocks per request [S], their ids [S, num_blocks], the first's [S], which
    of a partial block's keys are read [S, MAX_PARTIAL_BLOCKS, block_size]), or None: a request reads more partial
    blocks than MAX_PARTIAL_BLOCKS. Ids are listed in table order, padded with block 0 to the pool's width (at
    least), which flex_attention asks of a block mask over the whole pool."""
    S, B = block_tables.shape
    keys = mask.view(S, B, block_size)
    full = keys.all(-1)
    partial = keys.any(-1) & ~full
    num_partial = partial.sum(1, dtype=torch.int32)
    if S and int(num_partial.max()) > MAX_PARTIAL_BLOCKS:
        return None
    ids = []
    for taken in (full, partial):
        order = torch.argsort(~taken, dim=1, stable=True)  # the blocks taken first, in table order
        padded = torch.zeros(S, max(num_blocks, B), dtype=torch.int32, device=block_tables.device)
        padded[:, :B] = block_tables.gather(1, order)
        ids.append((padded, order))
    (full_ids, _), (partial_ids, partial_order) = ids
    partial_keys = torch.zeros(S, MAX_PARTIAL_BLOCKS, block_size, dtype=torch.bool, device=mask.device)
    first = partial_order[:, :MAX_PARTIAL_BLOCKS]
    partial_keys[:, : first.shape[1]] = keys.gather(1, first[:, :, None].expand(-1, -1, block_size))
    # the first partial block's id again, a tensor of its own: a mask function that read the block mask's own ids
    # tensor failed to compile ("'kv_indices' was not declared in this scope", torch 2.13)
    first_partial = partial_ids[:, 0].clone()
    return full.sum(1, dtype=torch.int32), full_ids, num_partial, partial_ids, first_partial, partial_keys


def thread_shares(work: list[int], heads: int, threads: int) -> list[float]:
    """Each thread's work when a kernel splits len(work) × heads items (request by request, its heads together) into
    contiguous shares of ceil(items / threads), as at::parallel_for does; an item costs its request's work / heads
    plus one (its own start)."""
    items = len(work) * heads
    threads = max(1, min(threads, items))
    share = -(-items // threads) if items else 1
    loads = [0.0] * threads
    for item in range(items):
        loads[item // share] += work[item // heads] / heads + 1
    return loads


def thread_balanced_order(work: list[int], heads: int, threads: int) -> list[int] | None:
    """An order of the requests (indices into `work`, each request's blocks) in which the kernel's contiguous
    shares (thread_shares) hold about the same work: the most work first, each request to the share with the least
    so far that has room, the requests of a share kept in their given order (neighbours in a running batch took
    their blocks at about the same time, so they lie near each other). None when the given order is as good: its
    busiest share is less than REORDER_GAIN times the balanced order's."""
    if threads < 2 or len(work) < 2:
        return None
    share = -(-len(work) * heads // min(threads, len(work) * heads))
    rooms = [0] * threads
    for request in range(len(work)):
        rooms[request * heads // share] += 1  # the share a request's first item falls in
    shares: list[list[int]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for request in sorted(range(len(work)), key=lambda r: -work[r]):
        t = min((t for t in range(threads) if len(shares[t]) < rooms[t]), key=lambda t: loads[t])
        shares[t].append(request)
        loads[t] += work[request]
    order = [request for requests in shares for request in sorted(requests)]
    balanced = max(thread_shares([work[r] for r in order], heads, threads))
    return order if max(thread_shares(work, heads, threads)) >= REORDER_GAIN * balanced else None


def flex_decode_attention(block_size: int) -> CompiledFunction:
    """One query per request over its blocks in the pool (see the module's docstring), compiled; the block size is a
    constant of the block mask."""
    def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_full: torch.Tensor,
                    full_ids: torch.Tensor, num_partial: torch.Tensor, partial_ids: torch.Tensor,
                    first_partial: torch.Tensor, partial_keys: torch.Tensor) -> torch.Tensor:
        """q [S, kv_heads, heads per kv head, head_dim], already scaled: each kv head's query heads are its query
        rows; k, v: one layer's row of the pool, [slots, kv_heads, head_dim]; the rest block_mask_inputs'."""
        S = q.shape[0]

        def partial_block(b, h, q_idx, kv_idx):  # evaluated on partial blocks only: the first or the second
            offset = kv_idx % block_size
            return torch.where(kv_idx // block_size == first_partial[b], partial_keys[b, 0, offset],
                               partial_keys[b, 1, offset])

        block_mask = BlockMask.from_kv_blocks(
            num_partial.view(S, 1, 1), partial_ids.view(S, 1, 1, -1), num_full.view(S, 1, 1),
            full_ids.view(S, 1, 1, -1), BLOCK_SIZE=(128, block_size), mask_mod=partial_block,
            seq_lengths=(q.shape[2], k.shape[0]), compute_q_blocks=False)
        return flex_attention(q, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], block_mask=block_mask,
                              scale=1.0)

    return CompiledFunction(flex_decode)
