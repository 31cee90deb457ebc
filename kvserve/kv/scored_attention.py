"""Attention written out, for the eviction policies that need more of it than its output: H2O adds up the
probabilities each key receives, and StreamingLLM scores its sink keys with a differently rotated query.

Each is a reader wrapped around the format's own (kv/readers.py), installed by the policy once, at start
(EvictionPolicy.attention_reader): the wrapper reads the group's keys as the format does and attends over them
written out, where the format's reader would call one fused kernel."""
from __future__ import annotations

import torch

from kvserve.kv.readers import AttentionGroup, GatherReader, GroupReader
from kvserve.rotation import apply_rotary


class AttentionScores:
    """H2O's accumulated attention per cache slot: summed over layers, heads and queries, reset when a block is
    freed (a block's score belongs to the sequences holding it)."""

    def __init__(self, num_slots: int, block_size: int, device: str | torch.device = "cpu"):
        self.block_size = block_size
        self.per_slot = torch.zeros(num_slots, dtype=torch.float32, device=device)

    def reset(self, block_ids: list[int]) -> None:
        if block_ids:
            self.per_slot.view(-1, self.block_size)[torch.tensor(block_ids)] = 0

    def block_scores(self, block_ids: list[int]) -> list[float]:
        return self.per_slot.view(-1, self.block_size)[torch.tensor(block_ids)].sum(dim=1).tolist()


class H2OScoredReader(GroupReader):
    """H2O: every group written out, the attention each key receives added to `scores` at the key's slot."""

    def __init__(self, reader: GatherReader, scores: AttentionScores):
        self.reader, self.scores = reader, scores

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, group: AttentionGroup,
                     scale: float) -> torch.Tensor:
        return scored_group(self.reader, q, k, v, layer, group, scale, self.scores)


class SinkScoredReader(GroupReader):
    """StreamingLLM: a group whose queries are past the sinks' reach (`sink_rotation`) written out, its sink keys
    scored with the query rotated back by the gap (engine/attention_mask.py); other groups as the format reads."""

    def __init__(self, reader: GatherReader):
        self.reader = reader

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, group: AttentionGroup,
                     scale: float) -> torch.Tensor:
        if group.sink_rotation is None:
            return self.reader.attend_group(q, k, v, layer, group, scale)
        return scored_group(self.reader, q, k, v, layer, group, scale, None)


def scored_group(reader: GatherReader, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 group: AttentionGroup, scale: float, scores: AttentionScores | None) -> torch.Tensor:
    """One group's attention, written out over the keys `reader` gathers for it: [S, Q, H, D]."""
    queries = q[group.query_index]  # [S, Q, H, D]
    keys, values, mask = reader.keys(k, v, layer, group)
    rotation = reader.rotation(group)  # stored K/V are rotated: rotate queries alike, undo after
    out = written_out_attention(queries, keys, values, mask, scale, group, scores, rotation)
    return out if rotation is None else out @ rotation.T


def written_out_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float, group: AttentionGroup, scores: AttentionScores | None,
                          rotation: torch.Tensor | None) -> torch.Tensor:
    """Attention written out, for when the probabilities are needed or sink keys take a rotated query. With a
    storage `rotation`, the output is in rotated coordinates (the caller rotates it back)."""
    S, Q, H, D = queries.shape
    kv_heads = keys.shape[2]
    per_kv = H // kv_heads

    def logits(qs: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:  # [S, KVH, per_kv * Q, K]
        if rotation is not None:  # after RoPE (the sink rotation included): stored keys were rotated after it
            qs = qs @ rotation
        qs = qs.view(S, Q, kv_heads, per_kv, D).permute(0, 2, 3, 1, 4).reshape(S, kv_heads, per_kv * Q, D)
        return qs @ ks.permute(0, 2, 3, 1) * scale

    weights = logits(queries, keys)
    if group.sink_rotation is not None:
        cos, sin = group.sink_rotation
        num_sink = group.sink_keys.shape[1]
        rotated = logits(apply_rotary(queries, cos, sin), keys[:, :num_sink])
        is_sink = group.sink_keys[:, None, None, :]
        weights[..., :num_sink] = torch.where(is_sink, rotated, weights[..., :num_sink])
    weights = weights.view(S, kv_heads, per_kv, Q, -1).masked_fill(~mask.view(S, 1, 1, Q, -1), float("-inf"))
    probs = weights.softmax(dim=-1)
    if scores is not None:
        received = (probs * group.query_valid.view(S, 1, 1, Q, 1)).sum(dim=(1, 2, 3))  # [S, K]
        taken = group.key_slots >= 0
        scores.per_slot.index_add_(0, group.key_slots[taken], received[taken].float())
    out = probs.view(S, kv_heads, per_kv * Q, -1) @ values.permute(0, 2, 1, 3)  # [S, KVH, per_kv * Q, D]
    return out.view(S, kv_heads, per_kv, Q, D).permute(0, 3, 1, 2, 4).reshape(S, Q, H, D)
