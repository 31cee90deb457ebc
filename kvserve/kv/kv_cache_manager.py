"""Per-request block tables on top of the block pool: allocate, grow, share (prefix hits, forks), copy on write, free."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.kv.block_hash import BlockHash, hash_full_blocks
from kvserve.kv.block_pool import Block, BlockPool


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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_namespace: str = ""):
        self.block_size = block_size
        self.hash_namespace = hash_namespace  # blocks of another storage format can never be hits
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already in the prefix index
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_allocated_slots(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ())) * self.block_size

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
        table = self._tables.setdefault(seq.request_id, [])
        start = seq.num_computed_tokens + len(cached) * self.block_size
        num_new_blocks = blocks_needed(start + num_new_tokens, self.block_size) - len(table) - len(cached)
        shared = self._shared_partial_block(table, start) if not cached else None
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)  # taking these removes them from the free queue
        if max(num_new_blocks, 0) + (shared is not None) > self.pool.num_free_blocks - reclaimed:
            if not table:
                del self._tables[seq.request_id]
            return None
        self.pool.touch(cached)
        table.extend(cached)
        copies = []
        if shared is not None:
            new_block = self.pool.allocate(1)[0]
            copies.append(BlockCopy(table[shared].block_id, new_block.block_id))
            self.pool.free([table[shared]])
            table[shared] = new_block
        table.extend(self.pool.allocate(max(num_new_blocks, 0)))
        return copies

    def cache_full_blocks(self, seq: CachedSequence) -> None:
        """Register the blocks that became full since the last call, so later requests can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        done = self._num_registered.get(seq.request_id, 0)
        if num_full <= done:  # the common decode step: the last block is still filling
            return
        hashes = self._block_hashes(seq, num_full * self.block_size)
        table = self._tables[seq.request_id]
        for block, block_hash in zip(table[done:num_full], hashes[done:num_full]):
            self.pool.register(block, block_hash)
        self._num_registered[seq.request_id] = num_full

    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """The child shares every parent block (copy-on-write when either writes into a shared one)."""
        table = list(self._tables.get(parent.request_id, ()))
        self.pool.touch(table)
        self._tables[child.request_id] = table
        if parent.request_id in self._hashes:  # only computed blocks: the child's uncomputed tokens may differ
            computed = parent.num_computed_tokens // self.block_size
            self._hashes[child.request_id] = self._hashes[parent.request_id][:computed]
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def free(self, seq: CachedSequence) -> None:
        """Return the request's blocks, tail first, so its head stays cached longest."""
        table = self._tables.pop(seq.request_id, [])
        self._hashes.pop(seq.request_id, None)
        self._num_registered.pop(seq.request_id, None)
        self.pool.free(reversed(table))

    def _shared_partial_block(self, table: list[Block], start: int) -> int | None:
        index = start // self.block_size
        if start % self.block_size and index < len(table) and table[index].ref_cnt > 1:
            return index
        return None

    def _block_hashes(self, seq: CachedSequence, num_tokens: int | None = None) -> list[BlockHash]:
        num_blocks = (len(seq.token_ids) if num_tokens is None else num_tokens) // self.block_size
        known = self._hashes.get(seq.request_id, [])
        if len(known) < num_blocks:
            known = hash_full_blocks(seq.token_ids[: num_blocks * self.block_size], self.block_size,
                                     seq.cache_salt, known, self.hash_namespace)
            self._hashes[seq.request_id] = known
        return known[:num_blocks]
