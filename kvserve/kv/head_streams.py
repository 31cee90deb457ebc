"""Per-(layer, KV head) page streams: the storage and attention read of `--kv-eviction adakv`.

The pool's unit is a block of `block_size` tokens of ONE layer's ONE KV head (a head block): K and V as floats
([head blocks × block_size, head_dim] each; or int8 with a bfloat16 scale per slot, Int8HeadStreamKVCache; or int4
codes of Hadamard-rotated vectors with a float16 scale and zero point per slot, Int4HeadStreamKVCache) and each
slot's token position (int32), which is what the mask compares (keys keep the RoPE of their original position, so
nothing is rotated again when tokens move). A sequence holds one stream per (layer, head), each its own list of head
blocks (head_manager.py), so heads keep different tokens and different counts and a head's dropped tokens free whole
head blocks.

A step is described once by the runner (engine/head_runner.py): the slots every new token goes to in every stream
([layers, tokens, heads]) and, per attention call, the calls' block tables as one tensor [layers, S, heads, B] with
the streams' lengths [layers, S, heads]. Attention then gathers one layer's heads in one indexed read and masks each
head by its own length and by position (causal), no loop over heads. The reader also adds up each sequence's
queries before RoPE (QueryStats) for the expected-attention scorer and, where the scorer reads them
(`window_queries`), keeps each sequence's latest queries as they were asked (after RoPE) for the observed one."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kv.formats.int4 import SCALE_DTYPE as INT4_SCALE_DTYPE
from kvserve.kv.formats.int4 import quantize as quantize_int4
from kvserve.kv.formats.int8 import dequantize_int8, quantize_int8
from kvserve.kv.formats.per_token import SCALE_DTYPE
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.readers import AttentionReader
from kvserve.kv.scorers import QueryStats
from kvserve.planner.layout import KVLayout
from kvserve.rotation import apply_rotary, hadamard

FAR_POSITION = 2**30  # a padded query's position: it sees every stored key, so no row is fully masked


@dataclass
class HeadCall:
    """One attention call over head streams: S sequences' queries padded to Q."""

    query_index: torch.Tensor  # [S, Q] rows of the flat batch (padding: 0)
    query_positions: torch.Tensor  # [S, Q] (padding: FAR_POSITION)
    block_tables: torch.Tensor  # [layers, S, heads, B] head block ids (padding: the null block)
    lengths: torch.Tensor  # [layers, S, heads] tokens each stream holds, this step's included
    out_rows: torch.Tensor | None  # flat rows of the [S * Q] output that are real queries (None: all)
    out_tokens: torch.Tensor | None  # the batch rows they go to


@dataclass
class QueryRecord:
    """Which of a step's tokens add to which sequence's QueryStats: the step's sequences in order, each token's
    index among them ([T]), and whether it counts ([T]: sink positions are left out, as kvpress does)."""

    request_ids: list[str]
    sequence_of: torch.Tensor
    counted: torch.Tensor
    cos: torch.Tensor  # [T, 1, D] RoPE of each token's position, to take it back off the queries
    sin: torch.Tensor


class HeadStreamKVCache(PagedKVCache):
    """K/V of `num_blocks` head blocks, each `block_size` tokens of one (layer, KV head), in float storage
    (Int8HeadStreamKVCache: int8 with a scale per token)."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 storage_dtype: torch.dtype | None = None, num_query_heads: int | None = None,
                 window_queries: int = 0):
        super().__init__(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        self.storage_dtype = storage_dtype or dtype
        self.exact = self.storage_dtype == dtype
        self.null_block = num_blocks  # one block past the pool's, never written: padded table entries read it
        slots = (num_blocks + 1) * block_size
        self._allocate(slots)
        self.positions = torch.zeros(slots, dtype=torch.int32, device=device)
        self.num_layers_total = len(layout.group_of)
        self.num_query_heads = num_query_heads or num_kv_heads
        self.reader = HeadStreamReader(self)
        self.query_stats: dict[str, QueryStats] = {}
        self._slots = torch.zeros(0, 0, num_kv_heads, dtype=torch.long)
        self._record: QueryRecord | None = None
        self._step_totals = self._step_squares = None
        self.window_queries = window_queries  # each sequence's latest queries, kept for its scorer (QueryStats)

    @property
    def format_name(self) -> str:
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.storage_dtype]

    def _allocate(self, slots: int) -> None:
        # zeros: masked slots are still multiplied by 0 in attention, which an uninitialised NaN would spread
        self.k = torch.zeros(slots, self.head_dim, dtype=self.storage_dtype, device=self.device)
        self.v = torch.zeros(slots, self.head_dim, dtype=self.storage_dtype, device=self.device)

    def _slot_tensors(self) -> list[torch.Tensor]:
        """Everything held per slot but its position, each [slots, ...]."""
        return [self.k, self.v]

    def _store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V ([n, D], compute dtype) into flat slots [n]."""
        self.k.index_copy_(0, slots, k.to(self.storage_dtype))
        self.v.index_copy_(0, slots, v.to(self.storage_dtype))

    def _load(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of head block tables [..., B]: [..., B, block_size, D] each, as stored."""
        return (self.k.view(-1, self.block_size, self.head_dim)[tables],
                self.v.view(-1, self.block_size, self.head_dim)[tables])

    def describe(self) -> str:
        """The format and the unit of its pool; each slot's position (int32) is held beside the blocks."""
        window = (f"; each sequence's latest {self.window_queries} queries kept for its scorer outside the pool "
                  f"({self.window_nbytes() / 2**20:.1f} MiB a sequence)") if self.window_queries else ""
        return (f"{self.format_name}, blocks of {self.block_size} tokens of one layer's one KV head "
                f"({self.num_blocks:,} of them), plus {self.positions.nbytes / 2**20:.1f} MiB of token "
                f"positions{window}")

    def window_nbytes(self) -> int:
        """Bytes of one sequence's window of queries (float32, every layer and query head)."""
        return self.num_layers_total * self.num_query_heads * self.window_queries * self.head_dim * 4

    def _block_tensors(self) -> list[torch.Tensor]:
        pool_slots = self.num_blocks * self.block_size  # the null block is no block of the pool
        return [t[:pool_slots].reshape(1, pool_slots, -1) for t in self._slot_tensors()]

    # ---- a step ------------------------------------------------------------------------------------------------
    def begin_head_step(self, slots: torch.Tensor, positions: torch.Tensor, fresh_blocks: list[int],
                        record: QueryRecord) -> None:
        """The step's slots [layers, T, heads] and token positions [T]; head blocks newly taken are zeroed first
        (their old contents are never read, not even masked)."""
        if fresh_blocks:
            rows = self._block_rows(torch.tensor(fresh_blocks, device=self.device))
            for tensor in (*self._slot_tensors(), self.positions):
                tensor[rows] = 0
        self._slots = slots
        if slots.numel():
            self.positions[slots.reshape(-1)] = positions[None, :, None].expand_as(slots).reshape(-1).int()
        self._record = record
        num_seqs = len(record.request_ids)
        shape = (self.num_layers_total, num_seqs, self.num_query_heads, self.head_dim)
        self._step_totals = torch.zeros(shape)
        self._step_squares = torch.zeros(shape)
        self._step_window = [None] * self.num_layers_total
        if self.window_queries:  # the rows of each sequence's latest counted tokens (a sequence's are contiguous)
            counted = record.counted > 0
            cum = counted.long().cumsum(0)
            last = torch.zeros(num_seqs, dtype=torch.long, device=cum.device).scatter_reduce(
                0, record.sequence_of, cum, "amax")
            self._window_rows = (counted & (last[record.sequence_of] - cum < self.window_queries)).nonzero()[:, 0]
            self._window_positions = positions[self._window_rows]

    def begin_step(self, freed_blocks, copies, slot_mappings) -> None:
        """The base step hook: a head-stream step is described by begin_head_step instead; copies never arise."""

    def end_head_step(self) -> None:
        """Add the step's queries to each sequence's QueryStats."""
        record = self._record
        counts = torch.zeros(len(record.request_ids), dtype=torch.long).index_add_(
            0, record.sequence_of, record.counted.long())
        window = window_of = None
        if self.window_queries and self._window_rows.numel():
            window = torch.stack(self._step_window).permute(0, 2, 1, 3)  # [L, Hq, rows, D]
            window_of = record.sequence_of[self._window_rows]
        for i, request_id in enumerate(record.request_ids):
            stats = self.query_stats.get(request_id)
            if stats is None:
                stats = self.query_stats[request_id] = QueryStats.empty(self.num_layers_total, self.num_query_heads,
                                                                        self.head_dim)
            stats.add(self._step_totals[:, i], self._step_squares[:, i], int(counts[i]))
            if window is not None:
                mine = window_of == i
                if bool(mine.any()):
                    stats.add_window(window[:, :, mine], self._window_positions[mine], self.window_queries)
        self._record = None

    def forget(self, request_id: str) -> None:
        self.query_stats.pop(request_id, None)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K/V of `layer` ([T, heads, D]) into each head's stream."""
        self._store(self._slots[layer].reshape(-1), k.reshape(-1, self.head_dim), v.reshape(-1, self.head_dim))

    def record_queries(self, layer: int, q: torch.Tensor) -> None:
        """Add layer `layer`'s queries ([T, Hq, D], after RoPE) to the step's sums, RoPE taken off."""
        record = self._record
        pre = apply_rotary(q.float(), record.cos, -record.sin) * record.counted[:, None, None]
        self._step_totals[layer].index_add_(0, record.sequence_of, pre)
        self._step_squares[layer].index_add_(0, record.sequence_of, pre * pre)
        if self.window_queries:
            self._step_window[layer] = q[self._window_rows].float()

    # ---- streams -----------------------------------------------------------------------------------------------
    def _block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Every slot of `blocks` ([n]) as flat rows [n * block_size]."""
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size, device=blocks.device)).reshape(-1)

    def gather_streams(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [..., B * block_size, D] (as stored, or dequantized to the compute dtype) and positions
        [..., B * block_size] of head block tables [..., B]."""
        blocks_k, blocks_v = self._load(tables)
        positions = self.positions.view(-1, self.block_size)[tables]
        flat = (*tables.shape[:-1], tables.shape[-1] * self.block_size)
        return blocks_k.reshape(*flat, self.head_dim), blocks_v.reshape(*flat, self.head_dim), positions.reshape(flat)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots `src` to `dst` ([n] flat rows each; all sources read before any destination is written)."""
        for tensor in (*self._slot_tensors(), self.positions):
            tensor[dst] = tensor[src]


class Int8HeadStreamKVCache(HeadStreamKVCache):
    """Head streams in int8 with one bfloat16 scale per token (each slot is one token of one head: the int8
    format's per-token-head absmax scales, kv/formats/int8.py), dequantized as they are gathered."""

    format_name = "int8"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "storage_dtype": torch.int8})

    def _allocate(self, slots: int) -> None:
        super()._allocate(slots)
        self.k_scale = torch.zeros(slots, dtype=SCALE_DTYPE, device=self.device)
        self.v_scale = torch.zeros(slots, dtype=SCALE_DTYPE, device=self.device)

    def _slot_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.v_scale]

    def _store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_int8(x)
            codes.index_copy_(0, slots, q)
            scales.index_copy_(0, slots, scale)

    def _load(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (-1, self.block_size, self.head_dim)
        return tuple(dequantize_int8(codes.view(shape)[tables], scales.view(-1, self.block_size)[tables], self.dtype)
                     for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)))


class Int4HeadStreamKVCache(HeadStreamKVCache):
    """Head streams in 4 bits: each slot's K and V vectors rotated by a Hadamard matrix (as fp8 and the nuq formats
    rotate theirs, so that a few large channels spread over all), then asymmetric int4 codes with a float16 scale
    and zero point per slot (the int4 format's per-token quantization, kv/formats/int4.py: per channel over a block,
    as that format keeps keys, would not survive a slot moving alone when a stream is compacted), two codes a byte:
    the vector's two halves. Attention reads them in the rotated basis, the queries rotated and the outputs rotated
    back (Int4HeadStreamReader); gather_streams, which the scorers read, rotates them back."""

    format_name = "int4"

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 *args, **kwargs):
        if head_dim % 2:
            raise ValueError(f"int4 head streams pack two codes a byte: head_dim {head_dim} must be even (use "
                             "kv_cache_dtype int8)")
        super().__init__(layout, num_blocks, block_size, num_kv_heads, head_dim, *args,
                         **{**kwargs, "storage_dtype": torch.uint8})
        self.basis = hadamard(self.head_dim).to(device=self.device)  # float32, orthonormal
        self.reader = Int4HeadStreamReader(self)

    def _allocate(self, slots: int) -> None:
        self.k = torch.zeros(slots, self.head_dim // 2, dtype=torch.uint8, device=self.device)
        self.v = torch.zeros(slots, self.head_dim // 2, dtype=torch.uint8, device=self.device)
        self.k_scale, self.k_zero, self.v_scale, self.v_zero = (
            torch.zeros(slots, dtype=INT4_SCALE_DTYPE, device=self.device) for _ in range(4))

    def _slot_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.k_zero, self.v_scale, self.v_zero]

    def _store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        half = self.head_dim // 2
        for codes, scales, zeros, x in ((self.k, self.k_scale, self.k_zero, k), (self.v, self.v_scale, self.v_zero, v)):
            q, scale, zero = quantize_int4(x.float() @ self.basis, dim=-1)
            codes.index_copy_(0, slots, q[:, :half] | (q[:, half:] << 4))
            scales.index_copy_(0, slots, scale.view(-1))
            zeros.index_copy_(0, slots, zero.view(-1))

    def _load(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of head block tables [..., B] in the rotated basis, dequantized to the compute dtype."""
        bs = self.block_size
        loaded = []
        for codes, scales, zeros in ((self.k, self.k_scale, self.k_zero), (self.v, self.v_scale, self.v_zero)):
            packed = codes.view(-1, bs, self.head_dim // 2)[tables]
            x = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
            x = x * scales.view(-1, bs)[tables][..., None].float() + zeros.view(-1, bs)[tables][..., None].float()
            loaded.append(x.to(self.dtype))
        return loaded[0], loaded[1]

    def gather_rotated(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gather_streams' K and V in the rotated basis, as stored (what attention reads)."""
        return super().gather_streams(tables)

    def gather_streams(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys, values, positions = self.gather_rotated(tables)
        back = self.basis.T
        return (keys.float() @ back).to(self.dtype), (values.float() @ back).to(self.dtype), positions


class HeadStreamReader(AttentionReader):
    """A layer's attention over head streams: per call, one gather of every head's blocks, a mask per head from its
    length and the key positions, one SDPA call with each KV head's query heads as its rows."""

    def __init__(self, cache: HeadStreamKVCache):
        self.cache = cache

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, calls: list[HeadCall],
               scale: float) -> torch.Tensor:
        self.cache.record_queries(layer, q)
        if len(calls) == 1 and calls[0].out_rows is None:
            return self.attend_call(q, layer, calls[0], scale).reshape(q.shape)
        out = torch.empty_like(q)
        for call in calls:
            rows = self.attend_call(q, layer, call, scale).reshape(-1, *q.shape[1:])
            out[call.out_tokens] = rows[call.out_rows] if call.out_rows is not None else rows
        return out

    def attend_call(self, q: torch.Tensor, layer: int, call: HeadCall, scale: float) -> torch.Tensor:
        """[S, Q, Hq, D] outputs of one call."""
        keys, values, key_positions = self.streams(call.block_tables[layer])  # [S, H, K, D]
        S, H, K, D = keys.shape
        Q = call.query_index.shape[1]
        heads = q.shape[1]
        per_kv = heads // H
        stored = torch.arange(K, device=keys.device)[None, None, :] < call.lengths[layer][..., None]  # [S, H, K]
        seen = key_positions[:, :, None, :] <= call.query_positions[:, None, :, None]  # [S, H, Q, K]
        mask = (stored[:, :, None, :] & seen)[:, :, None].expand(S, H, per_kv, Q, K).reshape(S, H, per_kv * Q, K)
        queries = q[call.query_index].view(S, Q, H, per_kv, D).permute(0, 2, 3, 1, 4).reshape(S, H, per_kv * Q, D)
        out = F.scaled_dot_product_attention(self.in_stored_basis(queries), keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=mask, scale=scale)
        return self.out_of_stored_basis(out).view(S, H, per_kv, Q, D).permute(0, 3, 1, 2, 4).reshape(S, Q, heads, D)

    def streams(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V and positions of head block tables, in the basis attention reads them in."""
        return self.cache.gather_streams(tables)

    def in_stored_basis(self, queries: torch.Tensor) -> torch.Tensor:
        return queries

    def out_of_stored_basis(self, out: torch.Tensor) -> torch.Tensor:
        return out


class Int4HeadStreamReader(HeadStreamReader):
    """Attention over int4 streams in their rotated basis: q.k is (q H).(k H) and the output sum of p (v H) is the
    sum of p v times H, so the queries are rotated and the outputs rotated back instead of every stored token."""

    cache: Int4HeadStreamKVCache

    def streams(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cache.gather_rotated(tables)

    def in_stored_basis(self, queries: torch.Tensor) -> torch.Tensor:
        return (queries.float() @ self.cache.basis).to(queries.dtype)

    def out_of_stored_basis(self, out: torch.Tensor) -> torch.Tensor:
        return (out.float() @ self.cache.basis.T).to(out.dtype)
