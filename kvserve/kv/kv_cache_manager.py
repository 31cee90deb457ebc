"""Per-request block tables on top of the block pool: allocate, grow, share (prefix hits, forks), copy on write,
evict (an eviction policy drops blocks a sequence will not read again), free."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.kv.block_hash import BlockHash, hash_full_blocks
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.eviction import AttentionScores, EvictionPolicy


class CachedSequence(Protocol):
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None


@dataclass(frozen=True)
class BlockCopy:
    """Copy one physical block's K/V into another before the step's forward (copy-on-write)."""

    src: int
    dst: int


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class BlockTable:
    """A sequence's kept blocks in order, and which block of the sequence each one is (block number i holds
    tokens i * block_size onwards). Without eviction the numbers are 0, 1, 2, ...; eviction leaves gaps."""

    blocks: list[Block] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)

    @property
    def next_logical(self) -> int:
        return self.logical[-1] + 1 if self.logical else 0

    def extend(self, blocks: Sequence[Block]) -> None:
        first = self.next_logical
        self.blocks.extend(blocks)
        self.logical.extend(range(first, first + len(blocks)))

    def index(self, logical_block: int) -> int:
        """Where block number `logical_block` sits in the table (it is one of the newest: search from the end)."""
        for i in range(len(self.logical) - 1, -1, -1):
            if self.logical[i] == logical_block:
                return i
        raise KeyError(f"block {logical_block} is not held")

    def copy(self) -> BlockTable:
        return BlockTable(list(self.blocks), list(self.logical))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_namespace: str = "",
                 eviction: EvictionPolicy | None = None):
        self.block_size = block_size
        self.hash_namespace = hash_namespace  # blocks of another storage format can never be hits
        self.eviction = eviction or EvictionPolicy()
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, BlockTable] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already in the prefix index
        self._first_eviction: dict[str, int] = {}  # computed tokens when the sequence first dropped a block
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.num_evicted_blocks = 0

    def block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return [b.block_id for b in table.blocks] if table else []

    def block_table(self, request_id: str) -> BlockTable:
        return self._tables.get(request_id) or BlockTable()

    def num_allocated_slots(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table.blocks) * self.block_size if table else 0

    def num_stored_tokens(self, seq: CachedSequence) -> int:
        """Tokens of `seq` whose K/V the cache holds (computed ones, minus those in dropped blocks)."""
        bs, computed = self.block_size, seq.num_computed_tokens
        return sum(min(bs, max(0, computed - b * bs)) for b in self.block_table(seq.request_id).logical)

    def find_cached_prefix(self, seq: CachedSequence) -> list[Block]:
        """Longest run of cached full blocks from the start; the last token is always left to compute."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(seq)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate(
        self, seq: CachedSequence, num_new_tokens: int, cached: Sequence[Block] = ()
    ) -> list[BlockCopy] | None:
        """Make room for `num_new_tokens` more tokens after the computed (and `cached`) ones.
        Returns the copies that copy-on-write needs, or None, changing nothing, if the pool is short."""
        table = self._tables.setdefault(seq.request_id, BlockTable())
        start = seq.num_computed_tokens + len(cached) * self.block_size
        num_new_blocks = blocks_needed(start + num_new_tokens, self.block_size) - table.next_logical - len(cached)
        shared = self._shared_partial_block(table, start) if not cached else None
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)  # taking these removes them from the free queue
        if max(num_new_blocks, 0) + (shared is not None) > self.pool.num_free_blocks - reclaimed:
            if not table.blocks:
                del self._tables[seq.request_id]
            return None
        self.pool.touch(cached)
        table.extend(cached)
        copies = []
        if shared is not None:
            new_block = self.pool.allocate(1)[0]
            copies.append(BlockCopy(table.blocks[shared].block_id, new_block.block_id))
            self.pool.free([table.blocks[shared]])
            table.blocks[shared] = new_block
        table.extend(self.pool.allocate(max(num_new_blocks, 0)))
        return copies

    def cache_full_blocks(self, seq: CachedSequence) -> None:
        """Register the blocks that became full since the last call, so later requests can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, self._exact_tokens(seq)) // self.block_size
        done = self._num_registered.get(seq.request_id, 0)
        if num_full <= done:  # the common decode step: the last block is still filling
            return
        hashes = self._block_hashes(seq, num_full * self.block_size)
        table = self._tables[seq.request_id]
        for logical_block in range(done, num_full):
            self.pool.register(table.blocks[table.index(logical_block)], hashes[logical_block])
        self._num_registered[seq.request_id] = num_full

    def evict(self, seq: CachedSequence, scores: AttentionScores | None = None) -> int:
        """Drop the blocks the eviction policy says `seq` will not need; returns how many it dropped."""
        table = self._tables.get(seq.request_id)
        if table is None or not self.eviction.evicts:
            return 0
        block_scores = scores.block_scores([b.block_id for b in table.blocks]) if scores is not None else None
        drop = self.eviction.blocks_to_drop(table.logical, seq.num_computed_tokens, self.block_size, block_scores)
        if not drop:
            return 0
        self._first_eviction.setdefault(seq.request_id, seq.num_computed_tokens)
        dropped = set(drop)
        self.pool.free([table.blocks[i] for i in reversed(drop)])
        table.blocks = [b for i, b in enumerate(table.blocks) if i not in dropped]
        table.logical = [b for i, b in enumerate(table.logical) if i not in dropped]
        self.num_evicted_blocks += len(drop)
        return len(drop)

    def _exact_tokens(self, seq: CachedSequence) -> int:
        """Leading tokens whose K/V are what an uncompressed run computes: only their blocks may be shared."""
        limit = self.eviction.exact_tokens()
        first = self._first_eviction.get(seq.request_id)
        candidates = [n for n in (limit, first) if n is not None]
        return min(candidates) if candidates else seq.num_computed_tokens

    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """The child shares every parent block (copy-on-write when either writes into a shared one)."""
        table = self.block_table(parent.request_id).copy()
        self.pool.touch(table.blocks)
        self._tables[child.request_id] = table
        if parent.request_id in self._first_eviction:
            self._first_eviction[child.request_id] = self._first_eviction[parent.request_id]
        if parent.request_id in self._hashes:  # only computed blocks: the child's uncomputed tokens may differ
            computed = parent.num_computed_tokens // self.block_size
            self._hashes[child.request_id] = self._hashes[parent.request_id][:computed]
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def free(self, seq: CachedSequence) -> None:
        """Return the request's blocks, tail first, so its head stays cached longest."""
        table = self._tables.pop(seq.request_id, BlockTable())
        self._hashes.pop(seq.request_id, None)
        self._num_registered.pop(seq.request_id, None)
        self._first_eviction.pop(seq.request_id, None)
        self.pool.free(reversed(table.blocks))

    def _shared_partial_block(self, table: BlockTable, start: int) -> int | None:
        """The table index of the partly filled block the next token goes into, if another sequence shares it."""
        if start % self.block_size and table.logical and table.logical[-1] == start // self.block_size:
            if table.blocks[-1].ref_cnt > 1:
                return len(table.blocks) - 1
        return None

    def _block_hashes(self, seq: CachedSequence, num_tokens: int | None = None) -> list[BlockHash]:
        num_blocks = (len(seq.token_ids) if num_tokens is None else num_tokens) // self.block_size
        known = self._hashes.get(seq.request_id, [])
        if len(known) < num_blocks:
            known = hash_full_blocks(seq.token_ids[: num_blocks * self.block_size], self.block_size,
                                     seq.cache_salt, known, self.hash_namespace)
            self._hashes[seq.request_id] = known
        return known[:num_blocks]
