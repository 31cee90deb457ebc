"""Attention over a flat batch of tokens whose K/V live in the paged cache.

The batch mixes requests in prefill (many query tokens) and decode (one). Requests with the same kind of work
form a group; each group is one padded scaled-dot-product call per layer, reading K/V through precomputed slots."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kv.kv_cache import PagedKVCache


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [S, Q] flat token index of each (request, query row); padding points at 0
    block_tables: torch.Tensor | None  # [S, B] each request's blocks, padded with block 0 (None when fresh)
    mask: torch.Tensor | None  # [S, 1, Q, B * block_size] True where that query may attend to that key
    out_rows: torch.Tensor | None  # [M] rows of the padded [S*Q] output that are real tokens (None: all are)
    out_tokens: torch.Tensor | None  # [M] flat token index of each of those rows (None: rows are tokens in order)
    fresh: bool = False  # every request starts at position 0: its keys are this step's, so read no cache


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the runner and read by every layer."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens. Returns [T, H, D].
    sliding_window: the layer's window (None: full attention); masking comes with the sliding-window KV cache."""
    cache.write(layer, meta.slot_mapping, k, v)
    if len(meta.groups) == 1 and meta.groups[0].out_rows is None:
        return _group_attention(q, k, v, layer, cache, meta.groups[0], scale).reshape(q.shape)
    out = torch.empty_like(q)
    for group in meta.groups:
        rows = _group_attention(q, k, v, layer, cache, group, scale).reshape(-1, *q.shape[1:])
        out[group.out_tokens] = rows[group.out_rows] if group.out_rows is not None else rows
    return out


def _group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: PagedKVCache, group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    queries = q[group.query_index]  # [S, Q, H, D]
    if group.fresh:
        # Prompts computed from their first token: the keys are the new tokens themselves, and plain causal
        # masking is exact even with padding (a real query never sees a later, padded key) and skips half the work.
        keys, values, mask = k[group.query_index], v[group.query_index], None
    else:
        keys, values = cache.gather(layer, group.block_tables)  # [S, C, KVH, D]
        mask = group.mask
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)  # [S, Q, H, D]
