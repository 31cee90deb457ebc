"""Prefix keys and lookups across layer groups: each request's block hashes (computed once), each group's key for a
block, and the longest prefix every group can continue after, each group saying which cached blocks it needs."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvserve.kv.block_hash import BlockHash, hash_full_blocks
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.block_table import CachedPrefix, CachedSequence
from kvserve.kv.group_managers import GroupManager


class RequestHashes:
    """Each request's full-block hashes, extended as its tokens fill blocks."""

    def __init__(self, block_size: int, hash_namespace: str = ""):
        self.block_size = block_size
        self.hash_namespace = hash_namespace  # blocks of another storage format can never be hits
        self._hashes: dict[str, list[BlockHash]] = {}

    def block_hashes(self, seq: CachedSequence, num_tokens: int | None = None) -> list[BlockHash]:
        num_blocks = (len(seq.token_ids) if num_tokens is None else num_tokens) // self.block_size
        known = self._hashes.get(seq.request_id, [])
        if len(known) < num_blocks:
            known = hash_full_blocks(seq.token_ids[: num_blocks * self.block_size], self.block_size,
                                     seq.cache_salt, known, self.hash_namespace)
            self._hashes[seq.request_id] = known
        return known[:num_blocks]

    def prompt_hashes(self, seq: CachedSequence) -> list[BlockHash]:
        """Keys of the prompt's blocks a hit may cover: the last token is always computed."""
        return self.block_hashes(seq)[: (len(seq.token_ids) - 1) // self.block_size]

    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """Only computed blocks: the child's uncomputed tokens may differ."""
        if parent.request_id in self._hashes:
            computed = parent.num_computed_tokens // self.block_size
            self._hashes[child.request_id] = self._hashes[parent.request_id][:computed]

    def free(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)


class PrefixLookup:
    """Finds cached prefixes in the pool for every layer group at once."""

    def __init__(self, pool: BlockPool, groups: Sequence[GroupManager]):
        self.pool = pool
        self.groups = groups

    def key(self, block_hash: BlockHash, group: int) -> BlockHash:
        """Each layer group caches its own blocks of a prefix."""
        return block_hash if len(self.groups) == 1 else block_hash + bytes([group])

    def lookup(self, hashes: list[BlockHash]) -> list[list[Block | None]]:
        """Each group's pool block for each key (None: not cached)."""
        return [[self.pool.lookup(self.key(h, g)) for h in hashes] for g in range(len(self.groups))]

    def first_needed(self, num_blocks: int) -> list[int]:
        """Per group, the first block it must hold to continue after `num_blocks` cached ones."""
        return [group.first_needed(num_blocks) for group in self.groups]

    def longest_prefix(self, found: list[list[Block | None]]) -> CachedPrefix:
        """Longest prefix of whole blocks whose groups all hold what they need of it, from `lookup`'s answer."""
        num_blocks = self.longest_held(lambda g, i: found[g][i] is not None, 0, len(found[0]))
        firsts = self.first_needed(num_blocks)
        return CachedPrefix(num_blocks, [found[g][first:num_blocks] for g, first in enumerate(firsts)], firsts)

    def longest_held(self, held: Callable[[int, int], bool], num_cached: int, num_blocks: int) -> int:
        """The longest prefix, in blocks, between `num_cached` (known to be held) and `num_blocks`, for which
        `held(group, i)` is true of every block each group needs to continue after it."""
        limit = num_blocks
        for g, group in enumerate(self.groups):
            limit = group.hit_limit(partial(held, g), num_cached, limit)
        for length in range(limit, num_cached, -1):
            if all(held(g, i) for g, first in enumerate(self.first_needed(length)) for i in range(first, length)):
                return length
        return num_cached
