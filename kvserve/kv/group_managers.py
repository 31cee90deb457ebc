"""One manager per layer group of the KV layout, one class per kind of layer: full attention keeps every block,
a sliding window drops what its window has passed, an eviction policy (StreamingLLM, H2O) drops what it gives up.

Each manager holds its group's block tables and answers what differs by kind: which cached blocks a prefix hit needs
in the group, which blocks it can drop as the sequence grows, how many tokens it stores. What every group shares
(taking a hit's blocks, copy-on-write, growing, trimming, forking, freeing) is the base class's. The coordinator
(kv_cache_manager.py) builds them once with `make_group_managers`; a new kind of layer is a new class here."""
from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.block_table import BlockCopy, BlockTable, CachedSequence, blocks_needed
from kvserve.kv.eviction import AttentionScores, EvictionPolicy, StreamingPolicy
from kvserve.kv.head_manager import HeadStreamManager


@dataclass(slots=True)
class Growth:
    """How allocate grows one group's table: new blocks from block number `first_new`, and the table index of a
    shared partly filled block to copy first (None: none)."""

    first_new: int
    num_new: int
    copy_index: int | None

    @property
    def num_blocks(self) -> int:
        """Pool blocks the growth takes."""
        return self.num_new + (self.copy_index is not None)


class GroupManager(ABC):
    """One layer group's block tables, by request, over the pool every group shares."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}
        self.num_evicted_blocks = 0  # dropped by an eviction policy
        self.num_window_blocks_freed = 0  # dropped by a sliding window

    @abstractmethod
    def first_needed(self, num_blocks: int) -> int:
        """The first block the group must hold to continue after `num_blocks` cached ones."""

    @abstractmethod
    def hit_limit(self, held: Callable[[int], bool], start: int, stop: int) -> int:
        """The longest prefix (at most `stop` blocks) the group may serve, given `held(i)`: whether block i is
        cached; blocks before `start` are known to be."""

    @abstractmethod
    def drop_unneeded(self, seq: CachedSequence, scores: AttentionScores | None) -> None:
        """Drop the blocks of `seq` no later query of this group reads."""

    def exact_tokens(self, request_id: str) -> int | None:
        """Leading tokens whose K/V are what an uncompressed run computes (None: every computed one)."""
        return None

    def table(self, request_id: str) -> BlockTable:
        table = self.tables.get(request_id)
        return table if table is not None else BlockTable()

    def num_stored_tokens(self, seq: CachedSequence) -> int:
        """Tokens of `seq` whose K/V the group holds (computed ones, minus those in dropped blocks)."""
        bs, computed = self.block_size, seq.num_computed_tokens
        return sum(min(bs, max(0, computed - b * bs)) for b in self.table(seq.request_id).logical)

    def plan_growth(self, request_id: str, hit: int, start: int, end_block: int) -> Growth:
        """Room for the tokens from `start` up to block `end_block`, after a hit of `hit` blocks (0: none). New
        blocks start after the held ones, or at the chunk's first block (after a hit, or when a sliding group has
        dropped everything before it)."""
        table = self.table(request_id)
        first_new = max(hit if hit else table.next_logical, start // self.block_size)
        copy_index = self._shared_partial_block(table, start) if not hit else None
        return Growth(first_new, max(0, end_block - first_new), copy_index)

    def take_cached(self, request_id: str, cached: Sequence[Block], first_cached: int) -> None:
        """Hold the `cached` blocks of a prefix hit (logical blocks from `first_cached` on) in the request's table."""
        if cached:
            self.pool.touch(cached)
            self.tables.setdefault(request_id, BlockTable()).extend(cached, first_cached)

    def grow(self, request_id: str, growth: Growth) -> list[BlockCopy]:
        """Do `growth` (after take_cached, where the request hit a prefix); returns the copy copy-on-write needs."""
        table = self.tables.setdefault(request_id, BlockTable())
        copies = []
        if growth.copy_index is not None:
            shared = table.blocks[growth.copy_index]
            new_block = self.pool.allocate(1)[0]
            copies.append(BlockCopy(shared.block_id, new_block.block_id))
            self.pool.free([shared])
            table.blocks[growth.copy_index] = new_block
        table.extend(self.pool.allocate(growth.num_new), growth.first_new)
        return copies

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (speculative decoding: blocks only rejected draft
        tokens were written to)."""
        table = self.tables.get(request_id)
        if table is None:
            return
        cut = bisect.bisect_left(table.logical, blocks_needed(num_tokens, self.block_size))
        if cut < len(table.blocks):
            self.pool.free(reversed(table.drop(list(range(cut, len(table.blocks))))))

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every parent block."""
        table = self.table(parent_id).copy()
        self.pool.touch(table.blocks)
        self.tables[child_id] = table

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first, so its head stays cached longest."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pool.free(reversed(table.blocks))

    def _shared_partial_block(self, table: BlockTable, start: int) -> int | None:
        """The table index of the partly filled block the next token goes into, if another sequence shares it."""
        if start % self.block_size and table.logical and table.logical[-1] == start // self.block_size:
            if table.blocks[-1].ref_cnt > 1:
                return len(table.blocks) - 1
        return None


class FullAttentionManager(GroupManager):
    """Every query reads every earlier token: a prefix hit needs all its blocks, and no block is dropped."""

    def first_needed(self, num_blocks: int) -> int:
        return 0

    def hit_limit(self, held: Callable[[int], bool], start: int, stop: int) -> int:
        return next((i for i in range(start, stop) if not held(i)), stop)

    def drop_unneeded(self, seq: CachedSequence, scores: AttentionScores | None) -> None:
        return


class SlidingWindowManager(GroupManager):
    """Each query reads the last `window` tokens: a prefix hit needs only the window before its end, and blocks the
    window has passed are dropped (StreamingLLM's rule without sinks). With `tile_windows` (batch-invariant
    attention) a whole query tile, one block, reads the window of its first position."""

    def __init__(self, pool: BlockPool, block_size: int, window: int, tile_windows: bool = False):
        super().__init__(pool, block_size)
        self.window = window
        self.tile_windows = tile_windows
        self._rule = StreamingPolicy(recent_tokens=window)

    def first_needed(self, num_blocks: int) -> int:
        return min(num_blocks, max(0, num_blocks * self.block_size - self.window + 1) // self.block_size)

    def hit_limit(self, held: Callable[[int], bool], start: int, stop: int) -> int:
        return stop  # blocks before the window may be gone: first_needed says which it needs

    def drop_unneeded(self, seq: CachedSequence, scores: AttentionScores | None) -> None:
        table = self.tables.get(seq.request_id)
        if table is None:
            return
        position = seq.num_computed_tokens  # the next query
        first = position - position % self.block_size if self.tile_windows else position
        drop = self._rule.blocks_to_drop(table.logical, first, self.block_size)
        self.pool.free(table.drop(drop))
        self.num_window_blocks_freed += len(drop)


class EvictingManager(FullAttentionManager):
    """Full attention under an eviction policy (StreamingLLM, H2O): the policy drops blocks to bound a sequence's
    memory, after which its K/V differ from an uncompressed run's and its later blocks may not be shared."""

    def __init__(self, pool: BlockPool, block_size: int, policy: EvictionPolicy):
        super().__init__(pool, block_size)
        self.policy = policy
        self._first_eviction: dict[str, int] = {}  # computed tokens when the sequence first dropped a block

    def drop_unneeded(self, seq: CachedSequence, scores: AttentionScores | None) -> None:
        table = self.tables.get(seq.request_id)
        if table is None:
            return
        position = seq.num_computed_tokens  # the next query
        block_scores = scores.block_scores([b.block_id for b in table.blocks]) if scores else None
        drop = self.policy.blocks_to_drop(table.logical, position, self.block_size, block_scores)
        if drop:
            self._first_eviction.setdefault(seq.request_id, position)
            self.pool.free(table.drop(drop))
            self.num_evicted_blocks += len(drop)

    def exact_tokens(self, request_id: str) -> int | None:
        candidates = [n for n in (self.policy.exact_tokens(), self._first_eviction.get(request_id)) if n is not None]
        return min(candidates) if candidates else None

    def fork(self, parent_id: str, child_id: str) -> None:
        super().fork(parent_id, child_id)
        if parent_id in self._first_eviction:
            self._first_eviction[child_id] = self._first_eviction[parent_id]

    def free(self, request_id: str) -> None:
        self._first_eviction.pop(request_id, None)
        super().free(request_id)


def make_group_managers(pool: BlockPool, block_size: int, windows: Sequence[int | None], eviction: EvictionPolicy,
                        tile_windows: bool = False) -> list[GroupManager | HeadStreamManager]:
    """One manager per layer group: `windows` holds each group's sliding window (None: full attention, under
    `eviction` when it evicts)."""
    def manager(window: int | None) -> GroupManager:
        if window is not None:
            return SlidingWindowManager(pool, block_size, window, tile_windows)
        if eviction.per_head:
            return HeadStreamManager(pool, block_size, eviction)
        if eviction.evicts:
            return EvictingManager(pool, block_size, eviction)
        return FullAttentionManager(pool, block_size)

    return [manager(window) for window in windows]
