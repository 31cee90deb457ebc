"""The group manager of `--kv-eviction adakv`: each sequence holds one stream of head blocks per (layer, KV head)
(kv/head_streams.py) and keeps, per head, the tokens its scorer ranks highest within budgets AdaKV splits over
the heads of each layer (kv/scorers.py).

A sequence's streams are three tensors: `tables` [layers, heads, capacity] (head block ids), `num_blocks` and
`lengths` [layers, heads]. New tokens go to the end of every stream. When the tokens a layer holds per head exceed
the budget by more than a block (after a prompt chunk, or every block_size decode steps), the sequence is
compressed: every stream's tokens are scored, each layer's budget (budget_tokens × heads) is split over its heads,
each head's kept tokens move to the front of its stream in position order and the head blocks past them go back
to the pool. The first `sink_tokens` positions, the block being filled and the last `recent_tokens` are always kept.
A policy that weights heads (`headkv-span`) gives each (layer, head) its own share of the budget instead (the
weights the engine measured, engine/retrieval_heads.py), and compresses when the sequence's heads hold more than
the budget on average.

Prefix caching: a head block holds one head's tokens, not a block of the sequence, so nothing is registered in the
prefix index and no hit is taken (every sequence is computed from its first token). Forking (n > 1, beams) copies the
parent's streams into new head blocks."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.block_table import BlockTable, CachedSequence
from kvserve.kv.eviction import EvictionPolicy
from kvserve.kv.head_streams import HeadStreamKVCache
from kvserve.kv.scorers import QueryStats, Scorer, head_budgets

FLOOR_SHARE = 0.2  # each head keeps at least this share of the per-head budget (AdaKV's safeguard)


@dataclass
class HeadStreams:
    """One sequence's streams: head block ids [L, H, capacity], blocks held and tokens stored [L, H]."""

    tables: torch.Tensor
    num_blocks: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_heads: int) -> HeadStreams:
        zeros = torch.zeros(num_layers, num_heads, dtype=torch.long)
        return cls(torch.zeros(num_layers, num_heads, 0, dtype=torch.long), zeros, zeros.clone())

    def held_blocks(self, first: torch.Tensor | None = None) -> torch.Tensor:
        """Ids of the head blocks from block number `first` ([L, H], default 0) to the end of each stream."""
        cols = torch.arange(self.tables.shape[2])[None, None, :]
        start = first[..., None] if first is not None else 0
        return self.tables[(cols >= start) & (cols < self.num_blocks[..., None])]


@dataclass(slots=True)
class HeadGrowth:
    """How allocate grows a sequence's streams (group_managers.Growth's counterpart): each stream's new head blocks
    [L, H], `num_blocks` in all."""

    per_stream: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.per_stream.sum())


class HeadStreamManager:
    """Full attention with per-(layer, head) streams compressed to `policy.budget_tokens` per head on average. It
    answers the coordinator's calls as group_managers.GroupManager's subclasses do (that module picks it)."""

    def __init__(self, pool: BlockPool, block_size: int, policy: EvictionPolicy):
        self.pool, self.block_size, self.policy = pool, block_size, policy
        self.num_evicted_blocks = 0  # head blocks compression gave back
        self.num_window_blocks_freed = 0
        self.num_layers = self.num_heads = 0  # the storage's, once attached
        self.streams: dict[str, HeadStreams] = {}
        self.null_block = pool.num_blocks  # the storage's block past the pool, never written: padding reads it
        self.storage: HeadStreamKVCache | None = None
        self.scorer: Scorer | None = None
        self.head_weights: torch.Tensor | None = None  # each (layer, head)'s share of the budget, [L, H] (HeadKV)
        self._fresh: list[int] = []  # head blocks taken since the runner last asked (it zeroes them)
        self.num_compressions = 0

    def attach(self, storage: HeadStreamKVCache, scorer: Scorer, head_weights: torch.Tensor | None = None) -> None:
        """The storage whose tokens this manager moves when it compresses (its layers and KV heads are the streams
        of a sequence), the scorer that ranks them and, for a policy that weights heads (`retrieval_heads`), each
        (layer, KV head)'s share of the budget [L, H], averaging at most 1."""
        if storage.null_block != self.pool.num_blocks:
            raise ValueError(f"the storage holds {storage.null_block} head blocks, the pool {self.pool.num_blocks}")
        self.storage, self.scorer = storage, scorer
        if storage.window_queries != scorer.window_queries:
            raise ValueError(f"the storage keeps {storage.window_queries} queries a sequence, the scorer "
                             f"{scorer.name} reads {scorer.window_queries}")
        self.num_layers, self.num_heads = storage.num_layers_total, storage.num_kv_heads
        if self.policy.retrieval_heads != (head_weights is not None):
            needs = "needs" if self.policy.retrieval_heads else "takes no"
            raise ValueError(f"kv_eviction={self.policy.name!r} {needs} head weights")
        if head_weights is not None:
            if tuple(head_weights.shape) != (self.num_layers, self.num_heads):
                raise ValueError(f"head weights of shape {tuple(head_weights.shape)} for {self.num_layers} layers of "
                                 f"{self.num_heads} KV heads")
            if float(head_weights.mean()) > 1 + 1e-6 or bool((head_weights < 0).any()):
                raise ValueError("head weights must be at least 0 and average at most 1")
            p = self.policy
            kept = p.sink_tokens + p.recent_tokens + self.block_size  # what a head may have to keep (check_budget)
            smallest = float(head_weights.min())
            if smallest * p.budget_tokens < kept:  # else the heads would hold more than the plan counts
                raise ValueError(
                    f"kv_budget_tokens={p.budget_tokens} gives the head with the smallest share ({smallest:.2f}x) "
                    "fewer tokens than every head keeps (the sinks, the recent window and the block being filled: "
                    f"{kept}); give at least {math.ceil(kept / smallest)} tokens or lower kv_recent_tokens")
        self.head_weights = head_weights

    # ---- the coordinator's calls -------------------------------------------------------------------------------
    def first_needed(self, num_blocks: int) -> int:
        return 0

    def hit_limit(self, held: Callable[[int], bool], start: int, stop: int) -> int:
        return 0  # no prefix hits (module doc)

    def exact_tokens(self, request_id: str) -> int | None:
        return 0  # nothing enters the prefix index

    def table(self, request_id: str) -> BlockTable:
        return BlockTable()  # head blocks are no blocks of the sequence: see `streams`

    def num_stored_tokens(self, seq: CachedSequence) -> int:
        """Tokens a (layer, head) stream holds on average."""
        streams = self.streams.get(seq.request_id)
        return 0 if streams is None else round(streams.lengths.float().mean().item())

    def plan_growth(self, request_id: str, hit: int, start: int, end_block: int) -> HeadGrowth:
        streams = self.streams.get(request_id) or HeadStreams.empty(self.num_layers, self.num_heads)
        new_tokens = max(0, end_block * self.block_size - start)
        needed = -(-(streams.lengths + new_tokens) // self.block_size) - streams.num_blocks
        return HeadGrowth(needed.clamp_min(0))

    def take_cached(self, request_id: str, cached, first_cached: int) -> None:
        if cached:
            raise RuntimeError("per-head streams take no prefix hits (hit_limit is 0)")

    def grow(self, request_id: str, growth: HeadGrowth) -> list:
        streams = self.streams.setdefault(request_id, HeadStreams.empty(self.num_layers, self.num_heads))
        if growth.num_blocks:
            ids = torch.tensor([b.block_id for b in self.pool.allocate(growth.num_blocks)])
            self._fresh += ids.tolist()
            self._place(streams, growth.per_stream, ids)
        return []

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Drop the tokens at positions from `num_tokens` on (speculative decoding: rejected draft tokens) from every
        stream, and free the head blocks past what is left. They are the streams' last entries: a verification step
        appends the same tokens to every stream, and its sequence is compressed only after it (the engine's order)."""
        streams = self.streams.get(request_id)
        if streams is None or not int(streams.lengths.min()):
            return
        last = int(streams.lengths[0, 0]) - 1  # every stream ends at the same position
        slot = int(streams.tables[0, 0, last // self.block_size]) * self.block_size + last % self.block_size
        rejected = int(self.storage.positions[slot]) + 1 - num_tokens
        if rejected <= 0:
            return
        streams.lengths = streams.lengths - rejected
        new_blocks = -(-streams.lengths // self.block_size)
        self._release(streams.held_blocks(new_blocks))
        past = torch.arange(streams.tables.shape[2])[None, None, :] >= new_blocks[..., None]
        streams.tables = streams.tables.masked_fill(past, self.null_block)
        streams.num_blocks = new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child gets new head blocks holding a copy of each of the parent's streams."""
        parent = self.streams[parent_id]
        ids = torch.tensor([b.block_id for b in self.pool.allocate(int(parent.num_blocks.sum()))])
        child = HeadStreams.empty(self.num_layers, self.num_heads)
        self._place(child, parent.num_blocks, ids)
        child.lengths = parent.lengths.clone()
        src = self.storage._block_rows(parent.held_blocks())
        self.storage.move_slots(src, self.storage._block_rows(child.held_blocks()))
        self.streams[child_id] = child
        stats = self.storage.query_stats.get(parent_id)
        if stats is not None:  # the queries the child's stored tokens were asked with are the parent's
            self.storage.query_stats[child_id] = stats.copy()

    def free(self, request_id: str) -> None:
        streams = self.streams.pop(request_id, None)
        if streams is not None:
            self._release(streams.held_blocks())
        if self.storage is not None:
            self.storage.forget(request_id)

    def take_fresh_blocks(self) -> list[int]:
        fresh, self._fresh = self._fresh, []
        return fresh

    # ---- the runner's calls ------------------------------------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """Slots [L, H, num_tokens] of the sequence's next tokens in every stream (allocate made room)."""
        streams = self.streams[request_id]
        index = streams.lengths[..., None] + torch.arange(num_tokens)  # [L, H, n]
        blocks = streams.tables.gather(2, torch.div(index, self.block_size, rounding_mode="floor"))
        streams.lengths = streams.lengths + num_tokens
        return blocks * self.block_size + index % self.block_size

    # ---- compression -------------------------------------------------------------------------------------------
    def drop_unneeded(self, seq: CachedSequence, scores=None) -> None:
        streams = self.streams.get(seq.request_id)
        if streams is None:
            return
        # a layer's heads hold the budget on average, or (pooled across layers, or weighted) every head of the
        # sequence does
        lengths = streams.lengths.float()
        pooled = self.policy.across_layers or self.head_weights is not None
        held = lengths.mean() if pooled else lengths.mean(dim=1).max()
        if held <= self.policy.budget_tokens + self.block_size:
            return
        keep = self._choose(streams, seq.request_id, seq.num_computed_tokens)  # [L, H, K] bool
        self._compact(streams, keep)
        self.num_compressions += 1

    def _choose(self, streams: HeadStreams, request_id: str, position: int) -> torch.Tensor:
        """Which stored tokens each stream keeps, [L, H, K]: the protected ones, then AdaKV's budgets."""
        tables = streams.tables[:, :, : int(streams.num_blocks.max())]
        keys, values, key_positions = self.storage.gather_streams(tables)
        valid = torch.arange(keys.shape[2])[None, None, :] < streams.lengths[..., None]
        stats = self.storage.query_stats.get(request_id) or QueryStats.empty(
            self.num_layers, self.storage.num_query_heads, keys.shape[-1])
        scores = self.scorer.score(keys, values, valid, stats, position, key_positions)
        p = self.policy
        protect_from = min(position - p.recent_tokens, position - position % self.block_size)
        protected = valid & ((key_positions < p.sink_tokens) | (key_positions >= protect_from))
        scores = scores.masked_fill(protected, float("inf"))
        budgets = self._budgets(scores, valid, protected.sum(-1))
        rank = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True).argsort(-1)
        return valid & (rank < budgets[..., None])

    def _budgets(self, scores: torch.Tensor, valid: torch.Tensor, num_protected: torch.Tensor) -> torch.Tensor:
        """Tokens each stream keeps [L, H]: AdaKV's split of each layer's budget_tokens × heads (floors of
        FLOOR_SHARE of the budget), or of the sequence's budget_tokens × layers × heads (`across_layers`), or the
        budget for every head (`perhead`) or its weighted share (`head_weights`, rounded down, so that the heads
        hold no more than the budget on average); never fewer than its protected ones."""
        budget, stored = self.policy.budget_tokens, valid.sum(-1)
        if self.head_weights is not None:
            shares = (self.head_weights * budget).floor().long()
            return torch.minimum(torch.maximum(num_protected, shares), stored)
        if not self.policy.adaptive:
            return torch.minimum(torch.maximum(num_protected, torch.full_like(stored, budget)), stored)
        floors = torch.minimum(torch.maximum(num_protected, torch.full_like(stored, int(FLOOR_SHARE * budget))),
                               stored)
        if self.policy.across_layers:  # one pool: every (layer, head) of the sequence competes for the total
            L, H, K = scores.shape
            total = torch.minimum(torch.tensor([budget * L * H]), stored.sum().view(1))
            return head_budgets(scores.reshape(1, L * H, K), valid.reshape(1, L * H, K), floors.reshape(1, -1),
                                torch.maximum(total, floors.sum().view(1))).view(L, H)
        totals = torch.minimum(torch.full_like(stored[:, 0], budget * self.num_heads), stored.sum(-1))
        return head_budgets(scores, valid, floors, torch.maximum(totals, floors.sum(-1)))

    def _compact(self, streams: HeadStreams, keep: torch.Tensor) -> None:
        """Move each stream's kept tokens to its front, in order, and free the head blocks past them."""
        L, H, K = keep.shape
        bs = self.block_size
        new_lengths = keep.sum(-1)
        index = torch.arange(K)
        order = torch.where(keep, index, K + index).sort(dim=-1).values  # kept ones first, in position order
        moved = index[None, None, :] < new_lengths[..., None]  # [L, H, K]: destination j takes order[j]
        tables = streams.tables
        src = tables.gather(2, torch.div(order, bs, rounding_mode="floor").clamp_max(tables.shape[2] - 1)) * bs \
            + order % bs
        dst = tables.gather(2, torch.div(index, bs, rounding_mode="floor").expand(L, H, K)) * bs + index % bs
        self.storage.move_slots(src[moved], dst[moved])
        new_blocks = -(-new_lengths // bs)
        freed = streams.held_blocks(new_blocks)
        self._release(freed)
        past = torch.arange(tables.shape[2])[None, None, :] >= new_blocks[..., None]
        streams.tables = tables.masked_fill(past, self.null_block)  # padding reads the null block, never a freed one
        self.num_evicted_blocks += len(freed)
        streams.num_blocks, streams.lengths = new_blocks, new_lengths

    # ---- head blocks -------------------------------------------------------------------------------------------
    def _place(self, streams: HeadStreams, per_stream: torch.Tensor, ids: torch.Tensor) -> None:
        """Append `per_stream` [L, H] new head blocks, `ids` in stream order, to each stream's table."""
        width = int((streams.num_blocks + per_stream).max())
        if width > streams.tables.shape[2]:
            grown = torch.full((self.num_layers, self.num_heads, max(width, 2 * streams.tables.shape[2])),
                               self.null_block, dtype=torch.long)
            grown[:, :, : streams.tables.shape[2]] = streams.tables
            streams.tables = grown
        flat = per_stream.reshape(-1)
        stream_of = torch.repeat_interleave(torch.arange(flat.numel()), flat)
        first = torch.cumsum(flat, 0) - flat
        column = streams.num_blocks.reshape(-1)[stream_of] + torch.arange(len(ids)) - first[stream_of]
        streams.tables.view(-1, streams.tables.shape[2])[stream_of, column] = ids
        streams.num_blocks = streams.num_blocks + per_stream

    def _release(self, block_ids: torch.Tensor) -> None:
        blocks = self.pool.blocks
        self.pool.free([blocks[i] for i in reversed(block_ids.tolist())])
