"""Which key each query of a padded attention group may see, and what else attention needs to read the keys.

A group is S requests padded to Q queries over the keys gathered from their kept blocks (B blocks each), plus,
for a format that reads a query's own block in full precision (int4), that block's staged tokens and the chunk's
new tokens. The rules, all on token positions:
- causal: a key at position <= the query's;
- int4's own block: keys of the query's own block come only from the full-precision part, others only from
  the gathered (quantized) part;
- a sliding-window layer group: keys within the last `window` positions (the query included);
- streaming eviction: the first `sink_tokens` keys and the last `recent_tokens` (the query included), nothing in
  between; sink keys are scored with the query rotated back by the gap between the sinks and the window, so the
  query-to-sink distance is the one a cache of sinks followed by the window gives (StreamingLLM's positions);
- padded query rows see key 0 only, so no softmax row is empty."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.eviction import EvictionPolicy


@dataclass
class GroupChunk:
    """What the mask needs of one request in the group."""

    start: int  # position of its first query
    num_tokens: int
    block_ids: list[int]  # kept blocks, in order
    logical: list[int]  # which block of the sequence each kept block is
    slots: list[int]  # cache slot of each of its new tokens


@dataclass
class GroupKeys:
    table: torch.Tensor  # [S, B] kept blocks, padded with block 0
    mask: torch.Tensor  # [S, 1, Q, K] True where that query may see that key
    residual_blocks: torch.Tensor | None  # [S] block whose staged tokens precede the chunk (-1: none), int4 only
    key_slots: torch.Tensor  # [S, K] cache slot of each key (-1: padding), for attention scores
    sink_keys: torch.Tensor | None  # [S, A] which of the first A keys are sinks, scored with `sink_rotation`
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [S, Q, 1, D] rotating queries back


def group_keys(chunks: list[GroupChunk], q_idx: torch.Tensor, valid: torch.Tensor, block_size: int,
               exact_own_block: bool, policy: EvictionPolicy, window: int | None, rotary) -> GroupKeys:
    bs = block_size
    start = torch.tensor([c.start for c in chunks])[:, None]
    query_pos = start + q_idx  # [S, Q]
    max_blocks = max(len(c.block_ids) for c in chunks)
    table = torch.tensor([c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks])
    logical = torch.tensor([c.logical + [-1] * (max_blocks - len(c.logical)) for c in chunks])
    offsets = torch.arange(bs)
    key_pos = (logical[:, :, None] * bs + offsets).flatten(1)  # [S, B * bs]
    key_ok = (logical >= 0).repeat_interleave(bs, dim=1)
    key_slots = torch.where(key_ok, (table[:, :, None] * bs + offsets).flatten(1), -1)
    stored = torch.ones_like(key_ok)
    residual = None
    if exact_own_block:
        own_block = start // bs  # [S, 1]
        staged_pos = own_block * bs + offsets  # the own block's tokens computed in earlier steps
        own_table_block = torch.tensor([c.block_ids[c.logical.index(c.start // bs)] for c in chunks])[:, None]
        staged_slots = own_table_block * bs + offsets
        new_slots = torch.tensor([c.slots + [-1] * (len(q_idx) - len(c.slots)) for c in chunks])
        key_pos = torch.cat([key_pos, staged_pos, query_pos], dim=1)
        key_ok = torch.cat([key_ok, staged_pos < start, valid], dim=1)
        key_slots = torch.cat([key_slots, torch.where(staged_pos < start, staged_slots, -1), new_slots], dim=1)
        stored = torch.cat([stored, torch.zeros(len(chunks), bs + len(q_idx), dtype=torch.bool)], dim=1)
        residual = torch.where(start.squeeze(1) % bs > 0, own_table_block.squeeze(1), -1)
    kp, qp = key_pos[:, None, :], query_pos[:, :, None]
    visible = key_ok[:, None, :] & (kp <= qp)  # [S, Q, K]
    if exact_own_block:
        same_block = (kp // bs) == (qp // bs)
        visible &= torch.where(stored[:, None, :], ~same_block, same_block)
    if window is not None:
        visible &= kp > qp - window
    sink_keys, sink_rotation = None, None
    if policy.name == "streaming":
        sink, recent = policy.sink_tokens, policy.recent_tokens
        visible &= (kp < sink) | (kp > qp - recent)
        gap = (query_pos - recent + 1 - sink).clamp(min=0)  # tokens between the sinks and the query's window
        if sink and bool((gap > 0).any()):
            cos, sin = rotary.lookup(gap.flatten())
            sink_rotation = (cos.view(*gap.shape, 1, -1), -sin.view(*gap.shape, 1, -1))  # rotate back by `gap`
            sink_keys = key_pos[:, : -(-sink // bs) * bs] < sink
    visible &= valid[:, :, None]
    visible[:, :, 0] |= ~valid
    return GroupKeys(table, visible.unsqueeze(1), residual, key_slots, sink_keys, sink_rotation)
