"""How attention reads a KV cache: one reader per cache, chosen by its format when the cache is built.

A step's batch mixes requests in prefill (many query tokens) and decode (one). The runner describes each layer
group's attention as calls: padded groups of alike requests (AttentionGroup), or, in batch-invariant mode, query
tiles (TileCall). A reader attends one layer over them:
- GatherReader, every format's: a group's keys gathered from its blocks in whole (then, for a format that reads a
  query's own block in full precision, int4, that block's staged tokens and the chunk's new ones), one fused
  scaled-dot-product call (a single stream inside a compiled graph: products and sums, `decode_sums`); fresh
  prompts attend over their own new keys, causally.
- DecodeKernelReader, for a format with a compiled decode attention (int8 and int4 over their stored codes,
  float32 in place: `fused_decode`): one-query groups go to that kernel, the rest as GatherReader.
- TileReader, batch-invariant mode's: each query over exactly its tile's keys (kvserve/batch_invariant.py).
An eviction policy that needs the attention probabilities wraps the format's reader once, at start
(kv/scored_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.batch_invariant import RowTiles


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [S, Q] flat token index of each (request, query row); padding points at 0
    block_tables: torch.Tensor | None  # [S, B] each request's blocks, padded with block 0 (None when fresh)
    mask: torch.Tensor | None  # [S, 1, Q, keys] True where that query may attend to that key
    out_rows: torch.Tensor | None  # [M] rows of the padded [S*Q] output that are real tokens (None: all are)
    out_tokens: torch.Tensor | None  # [M] flat token index of each of those rows (None: rows are tokens in order)
    fresh: bool = False  # every request starts at position 0 and reads exactly: its keys are this step's own
    # cache.exact_own_block: the block whose staged, full-precision tokens precede each request's chunk (-1: none);
    # keys are then [gathered blocks | that block's staged tokens | the chunk's new tokens]
    residual_blocks: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None  # [S, keys] cache slot of each key (-1: none), where H2O adds scores
    query_valid: torch.Tensor | None = None  # [S, Q] real (not padded) query rows, for H2O
    sink_keys: torch.Tensor | None = None  # [S, A] which of the first A keys are StreamingLLM sinks ...
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # ... scored with queries rotated by this


@dataclass
class TileCall:
    """Batch-invariant attention for S query tiles, each P positions of one KV block of one request (P the same for
    the whole call), over the B blocks their keys live in: the same B for every tile, the tile's own block last."""

    query_index: torch.Tensor  # [S, P] flat token index of each position
    block_tables: torch.Tensor  # [S, B] blocks holding the keys, in order
    own_blocks: torch.Tensor  # [S] each tile's own block (block_tables[:, -1])
    mask: torch.Tensor  # [S, P, B * block_size] True where that position may attend to that key
    # cache.exact_own_block (int4): the own block read in full precision, offset by offset, from staging (tokens of
    # earlier steps) or from this step's new tokens; None for other formats, which read the own block as stored
    staged: torch.Tensor | None = None  # [S, block_size] offsets read from staging
    own_index: torch.Tensor | None = None  # [S, block_size] flat token index of the other offsets (0: unused)


class StoredKV(Protocol):
    """What readers read of a cache (kv_cache.PagedKVCache; a layer's row of one, kv_cache.LayerRow, offers gather
    and rotation, all a GatherReader of decode groups calls)."""

    block_size: int
    tiles: RowTiles
    rotation: torch.Tensor | None  # stored K/V are rotated by it: queries are rotated alike, outputs back

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_with_own_block(self, layer: int, block_tables: torch.Tensor, own_blocks: torch.Tensor,
                              new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_residual(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_attention(self, layer: int, queries: torch.Tensor, block_tables: torch.Tensor,
                         own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor | None: ...


class AttentionReader:
    """How one cache is read: a layer's attention over the step's calls for that layer's group."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, calls: list,
               scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens, already written. Returns [T, H, D]."""
        raise NotImplementedError

    def reads_decodes_in_place(self) -> bool:
        """Whether decodes are read where their blocks lie, nothing padded: the runner then attends a step's
        decodes in one call per layer group instead of buckets of alike context lengths."""
        return False


class GroupReader(AttentionReader):
    """Attends a layer's groups one by one (`attend_group`, the subclass's) into the step's [T, H, D] output."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, groups: list[AttentionGroup],
               scale: float) -> torch.Tensor:
        if len(groups) == 1 and groups[0].out_rows is None:
            return self.attend_group(q, k, v, layer, groups[0], scale).reshape(q.shape)
        out = torch.empty_like(q)
        for group in groups:
            rows = self.attend_group(q, k, v, layer, group, scale).reshape(-1, *q.shape[1:])
            out[group.out_tokens] = rows[group.out_rows] if group.out_rows is not None else rows
        return out

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, group: AttentionGroup,
                     scale: float) -> torch.Tensor:
        """One group's attention, [S, Q, H, D]."""
        raise NotImplementedError


class GatherReader(GroupReader):
    """Every format's read: keys gathered from the blocks, then one scaled-dot-product call."""

    def __init__(self, cache: StoredKV):
        self.cache = cache

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, group: AttentionGroup,
                     scale: float) -> torch.Tensor:
        return self.attend_gathered(q[group.query_index], k, v, layer, group, scale)

    def attend_gathered(self, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                        group: AttentionGroup, scale: float) -> torch.Tensor:
        """The group's queries ([S, Q, H, D]) over its gathered keys."""
        keys, values, mask = self.keys(k, v, layer, group)
        rotation = self.rotation(group)
        if rotation is not None:
            queries = queries @ rotation
        out = sdpa(queries, keys, values, mask, scale)
        return out if rotation is None else out @ rotation.T

    def keys(self, k: torch.Tensor, v: torch.Tensor, layer: int,
             group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys and values [S, keys, KVH, D] the group reads, and its mask (None: causal over the new tokens)."""
        if group.fresh:
            # Prompts computed from their first token: the keys are the new tokens themselves, and plain causal
            # masking is exact even with padding (a real query never sees a later, padded key) and skips half the work.
            return k[group.query_index], v[group.query_index], None
        if group.residual_blocks is None:
            keys, values = self.cache.gather(layer, group.block_tables)  # [S, C, KVH, D]
        else:
            keys, values = self.cache.gather_with_own_block(layer, group.block_tables, group.residual_blocks,
                                                            k[group.query_index], v[group.query_index])
        return keys, values, group.mask

    def rotation(self, group: AttentionGroup) -> torch.Tensor | None:
        """The rotation the group's keys were stored with (none for fresh keys, which were never stored)."""
        return None if group.fresh else self.cache.rotation


class DecodeKernelReader(GatherReader):
    """A format with a compiled decode attention (`fused_decode`): one-query groups read by it, over the stored form
    or in place; the rest, and decodes it declines (None: failed to compile, or not its case), as GatherReader."""

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, group: AttentionGroup,
                     scale: float) -> torch.Tensor:
        queries = q[group.query_index]  # [S, Q, H, D]
        S, Q, H, D = queries.shape
        if Q == 1 and not group.fresh:
            kv_heads = k.shape[1]
            out = self.cache.decode_attention(layer, queries.view(S, kv_heads, H // kv_heads, D), group.block_tables,
                                              group.residual_blocks, k[group.query_index], v[group.query_index],
                                              group.mask, scale)
            if out is not None:
                return out.reshape(S, Q, H, D)
        return self.attend_gathered(queries, k, v, layer, group, scale)

    def reads_decodes_in_place(self) -> bool:
        return self.cache.decode_reads_in_place()


def sdpa(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
         scale: float) -> torch.Tensor:
    """queries [S, Q, H, D] over keys and values [S, K, KVH, D]; mask [S, 1, Q, K] or None (causal). [S, Q, H, D]."""
    S, Q, H, D = queries.shape
    kv_heads = keys.shape[2]
    if S == 1 and Q == 1 and mask is not None and torch.compiler.is_compiling():
        return decode_sums(queries, keys, values, mask, scale)  # a single stream in the whole graph
    if Q == 1 and mask is not None:
        # Decode: the query heads that share a KV head become that head's query rows (one mask row fits all), so
        # the call needs no grouped-query support. On a CPU that is faster than enable_gqa (`kvserve bench
        # throughput --profile`, docs/benchmarks.md). Prefill stays grouped: its mask would have to be repeated per
        # head, which measured slower.
        out = F.scaled_dot_product_attention(queries.view(S, kv_heads, H // kv_heads, D), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=mask, scale=scale)
        return out.reshape(S, Q, H, D)  # a view where the kernel wrote it contiguously (the CPU's); CUDA's may not
    return F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # [S, Q, H, D]


def decode_sums(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """One query per request ([S, 1, H, D]) over keys and values [S, K, KVH, D] under mask [S, 1, 1, K], written as
    products, sums and a softmax for a graph torch.compile traces (the whole graph: compile/steps.py). Inductor
    fuses the keys' gather from the pool into the loops that read them, so the keys are read once, where they lie,
    with no copy and no kernel call of its own; the call to scaled_dot_product_attention it replaces read a gathered
    copy. `kvserve bench step` measures both (docs/benchmarks.md). Sums run in float32 in another order than the
    kernel's: a few ulps apart."""
    S, _, H, D = queries.shape
    K, kv_heads = keys.shape[1], keys.shape[2]
    q = queries.float().view(S, 1, kv_heads, H // kv_heads, D)
    scores = (keys.float()[:, :, :, None, :] * q).sum(-1) * scale  # [S, K, KVH, heads per KV head]
    scores = scores.masked_fill(~mask.view(S, K, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * values.float()[:, :, :, None, :]).sum(1)  # [S, KVH, heads per KV head, D]
    return out.view(S, 1, H, D).to(queries.dtype)


class TileReader(AttentionReader):
    """Batch-invariant mode's read: every query over its own tile's keys. Each position of a tile is a query head of
    its own with one query row, so the kernel computes every query alike — a [1, D] x [D, keys] problem, whether the
    position is decoded alone or prefilled with its block — and rows never mix; keys are shared through GQA."""

    def __init__(self, cache: StoredKV):
        self.cache = cache

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, calls: list[TileCall],
               scale: float) -> torch.Tensor:
        rotation, tiles = self.cache.rotation, self.cache.tiles
        if rotation is not None:  # stored K/V are rotated (fp8): queries alike, output back, token by token
            q = tiles.map(lambda x: x @ rotation, q)
        out = torch.empty_like(q)
        for call in calls:
            keys, values = self._keys(k, v, layer, call)
            out[call.query_index.reshape(-1)] = self._attend_call(q, keys, values, call, scale)
        return out if rotation is None else tiles.map(lambda x: x @ rotation.T, out)

    def _keys(self, k: torch.Tensor, v: torch.Tensor, layer: int,
              call: TileCall) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's keys and values [S, B * block_size, KVH, D]; the own block in full precision where staged."""
        keys, values = self.cache.gather(layer, call.block_tables)
        if call.staged is not None:  # the own block in full precision: staged tokens, then this step's
            bs = self.cache.block_size
            staged_k, staged_v = self.cache.gather_residual(layer, call.own_blocks)
            earlier = call.staged[:, :, None, None]
            keys[:, -bs:] = torch.where(earlier, staged_k, k[call.own_index])
            values[:, -bs:] = torch.where(earlier, staged_v, v[call.own_index])
        return keys, values

    @staticmethod
    def _attend_call(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: TileCall,
                     scale: float) -> torch.Tensor:
        """The call's positions' outputs, [S * P, H, D] in the order of its query_index."""
        (S, P), kv_heads, num_keys = call.query_index.shape, keys.shape[2], keys.shape[1]
        heads, dim = q.shape[1], q.shape[2]
        per_kv = heads // kv_heads
        # [S, P, H, D] -> heads ordered (kv head, position, query head of that kv head): GQA maps each to its kv head
        queries = q[call.query_index].view(S, P, kv_heads, per_kv, dim).transpose(1, 2).reshape(S, -1, 1, dim)
        mask = call.mask[:, None, :, None, :].expand(S, kv_heads, P, per_kv, num_keys).reshape(S, -1, 1, num_keys)
        rows = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                              scale=scale, enable_gqa=True)  # [S, KVH * P * per_kv, 1, D]
        return rows.reshape(S, kv_heads, P, per_kv, dim).transpose(1, 2).reshape(-1, heads, dim)
