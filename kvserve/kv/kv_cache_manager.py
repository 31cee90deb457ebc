"""Per-request block tables on top of the block pool: allocate, grow, share (prefix hits, forks), copy on write,
drop what a sliding window or an eviction policy no longer reads, free.

A request has one block table per layer group of the model's KVLayout. A full-attention group keeps every block
(unless an eviction policy drops some); a sliding-window group drops the blocks its window has passed."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvserve.kv.block_hash import BlockHash, hash_full_blocks
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.eviction import AttentionScores, EvictionPolicy, StreamingPolicy
from kvserve.kv.tiers.base import BlockLoad

if TYPE_CHECKING:
    from kvserve.kv.tiers.base import KVTier as DiskKVCache, TierRead as PrefixRead


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


@dataclass(frozen=True)
class _DiskLoad:
    """A prefix being read from the disk tier: the read, the pool blocks it fills and the pool's hits it holds."""

    read: PrefixRead
    blocks: list[Block]
    held: list[Block]
    hashes: list[BlockHash]
    num_cached: int  # the pool's own hit, in blocks


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class BlockTable:
    """A sequence's kept blocks in one layer group, in order, and which block of the sequence each one is (block
    number i holds tokens i * block_size onwards). Without dropping the numbers are 0, 1, 2, ...; a sliding window
    or an eviction policy leaves gaps."""

    blocks: list[Block] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)

    @property
    def next_logical(self) -> int:
        return self.logical[-1] + 1 if self.logical else 0

    def extend(self, blocks: Sequence[Block], first_logical: int | None = None) -> None:
        first = self.next_logical if first_logical is None else first_logical
        self.blocks.extend(blocks)
        self.logical.extend(range(first, first + len(blocks)))

    def index(self, logical_block: int) -> int:
        """Where block number `logical_block` sits in the table (it is one of the newest: search from the end)."""
        for i in range(len(self.logical) - 1, -1, -1):
            if self.logical[i] == logical_block:
                return i
        raise KeyError(f"block {logical_block} is not held")

    def drop(self, indices: list[int]) -> list[Block]:
        """Remove the entries at `indices`; returns their blocks."""
        gone = set(indices)
        dropped = [self.blocks[i] for i in indices]
        self.blocks = [b for i, b in enumerate(self.blocks) if i not in gone]
        self.logical = [n for i, n in enumerate(self.logical) if i not in gone]
        return dropped

    def copy(self) -> BlockTable:
        return BlockTable(list(self.blocks), list(self.logical))


@dataclass
class CachedPrefix:
    """A prefix hit: its first `num_blocks` blocks are cached; for each layer group, the cached blocks it needs
    (a sliding group needs only those in the window of the first token to compute), starting at `first_logical`."""

    num_blocks: int = 0
    blocks: list[list[Block]] = field(default_factory=list)
    first_logical: list[int] = field(default_factory=list)

    @property
    def all_blocks(self) -> list[Block]:
        return [b for group in self.blocks for b in group]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_namespace: str = "",
                 eviction: EvictionPolicy | None = None, windows: Sequence[int | None] = (None,),
                 tile_windows: bool = False, disk: DiskKVCache | None = None):
        self.block_size = block_size
        self.disk = disk  # a lower tier: registered blocks are written there, and lookups continue there
        if disk is not None:  # which block holds a key now: a block the writer skipped is written later from there
            disk.attach_pool(lambda key: block.block_id if (block := self.pool.lookup(key)) is not None else None)
        self.hash_namespace = hash_namespace  # blocks of another storage format can never be hits
        self.eviction = eviction or EvictionPolicy()
        self.windows = tuple(windows)  # per layer group: None for full attention, else its sliding window
        # a sliding group drops what no later query's window reaches: StreamingLLM's rule without sinks
        self._window_rules = [StreamingPolicy(recent_tokens=w) if w is not None else None for w in self.windows]
        # batch-invariant attention reads, for a whole query tile (one block), the window of its first position
        self.tile_windows = tile_windows
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, list[BlockTable]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each sequence already in the prefix index
        self._first_eviction: dict[str, int] = {}  # computed tokens when the sequence first dropped a block
        self._loads: dict[str, _DiskLoad] = {}  # by request: prefixes being read from the disk tier
        # requests waiting for admission whose prefix was read already: the pool's hit before the read and the
        # prefix the pool held after it, in blocks (what admission's hit owes to the disk tier)
        self._loaded: dict[str, tuple[int, int]] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.num_evicted_blocks = 0  # dropped by the eviction policy
        self.num_window_blocks_freed = 0  # dropped by sliding-window groups

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def block_ids(self, request_id: str) -> list[int]:
        """Every block the request holds, all layer groups."""
        return [b.block_id for table in self._tables.get(request_id, ()) for b in table.blocks]

    def block_table(self, request_id: str, group: int = 0) -> BlockTable:
        tables = self._tables.get(request_id)
        return tables[group] if tables else BlockTable()

    def num_allocated_slots(self, request_id: str) -> int:
        return len(self.block_ids(request_id)) * self.block_size

    def num_stored_tokens(self, seq: CachedSequence, group: int = 0) -> int:
        """Tokens of `seq` whose K/V one layer group holds (computed ones, minus those in dropped blocks)."""
        bs, computed = self.block_size, seq.num_computed_tokens
        return sum(min(bs, max(0, computed - b * bs)) for b in self.block_table(seq.request_id, group).logical)

    def num_wasted_slots(self, seq: CachedSequence) -> int:
        """Slots `seq` holds that hold no token (the unfilled end of each group's last block)."""
        return sum(len(self.block_table(seq.request_id, g).blocks) * self.block_size - self.num_stored_tokens(seq, g)
                   for g in range(self.num_groups))

    def find_cached_prefix(self, seq: CachedSequence) -> CachedPrefix:
        """Longest cached prefix of whole blocks whose full groups hold all of it and whose sliding groups hold
        the window before its end; the last token is always left to compute."""
        if not self.pool.enable_prefix_caching:
            return CachedPrefix(blocks=[[] for _ in self.windows], first_logical=[0] * self.num_groups)
        return self._longest_prefix(self._lookup(self._prompt_hashes(seq)))

    def prefix_loading(self, seq: CachedSequence) -> bool:
        """Whether `seq` waits for its prefix to be read from the disk tier. The read starts here when the disk
        holds more of the prefix than the pool; reader threads read and check the records while steps go on, and
        once they are done the blocks join the pool's prefix index, for find_cached_prefix to take."""
        if self.disk is None or not self.pool.enable_prefix_caching:
            return False
        self.collect_loads()
        if seq.request_id in self._loads:
            return True
        if seq.request_id in self._loaded:  # one read per admission: a pool too small for it must not loop
            return False
        hashes = self._prompt_hashes(seq)
        found = self._lookup(hashes)
        num_cached = self._longest_prefix(found).num_blocks
        if num_cached < len(hashes):
            load = self._start_disk_load(seq, hashes, found, num_cached)
            if load is not None:
                self._loads[seq.request_id] = load
                return True
        return False

    def collect_loads(self) -> None:
        """Put the finished disk reads' blocks into the pool's prefix index (on the step thread)."""
        for request_id, load in list(self._loads.items()):
            if load.read.done():
                del self._loads[request_id]
                self._loaded[request_id] = (load.num_cached, self._finish_disk_load(load))

    def wait_for_loads(self, timeout_s: float) -> None:
        """With nothing else to run: wait up to `timeout_s` for a disk read to finish (none pending: return)."""
        if self._loads:
            next(iter(self._loads.values())).read.wait(timeout_s)

    def _prompt_hashes(self, seq: CachedSequence) -> list[BlockHash]:
        """Keys of the prompt's blocks a hit may cover: the last token is always computed."""
        return self._block_hashes(seq)[: (len(seq.token_ids) - 1) // self.block_size]

    def _lookup(self, hashes: list[BlockHash]) -> list[list[Block | None]]:
        """Each group's pool block for each key (None: not cached)."""
        return [[self.pool.lookup(self._key(h, g)) for h in hashes] for g in range(self.num_groups)]

    def _longest_prefix(self, found: list[list[Block | None]]) -> CachedPrefix:
        limit = len(found[0])
        for g, window in enumerate(self.windows):
            if window is None:
                limit = min(limit, next((i for i, b in enumerate(found[g]) if b is None), len(found[g])))
        for num_blocks in range(limit, -1, -1):
            firsts = [self._first_needed(num_blocks, w) for w in self.windows]
            if all(b is not None for g, first in enumerate(firsts) for b in found[g][first:num_blocks]):
                return CachedPrefix(num_blocks, [found[g][first:num_blocks] for g, first in enumerate(firsts)],
                                    firsts)
        raise AssertionError("an empty prefix is always cached")

    def _start_disk_load(self, seq: CachedSequence, hashes: list[BlockHash], found: list[list[Block | None]],
                         num_cached: int) -> _DiskLoad | None:
        """Start reading what the longest prefix the pool and the disk hold together needs past the pool's hit of
        `num_cached` blocks, into pool blocks taken now; None if the disk holds no more than the pool."""
        num_blocks = self._disk_prefix_length(hashes, found, num_cached)
        firsts = [self._first_needed(num_blocks, w) for w in self.windows]
        wanted = sorted((i, g) for g, first in enumerate(firsts) for i in range(first, num_blocks)
                        if found[g][i] is None)
        # the pool's own hits are held while the read runs, so taking blocks cannot evict them
        held = [b for g, first in enumerate(firsts) for b in found[g][first:num_blocks] if b is not None]
        self.pool.touch(held)
        wanted = wanted[: self.pool.num_free_blocks]
        num_gained = max(i for i, _ in wanted) + 1 - num_cached if wanted else 0
        if not wanted or not self.disk.worth_reading(len(wanted), num_gained * self.block_size):
            self.pool.free(reversed(held))
            return None
        blocks = self.pool.allocate(len(wanted))
        loads = [BlockLoad(block.block_id, self._key(hashes[i], g), hashes[i - 1] if i else None,
                           self._block_tokens(seq, i)) for block, (i, g) in zip(blocks, wanted)]
        return _DiskLoad(self.disk.start_reading(loads), blocks, held, hashes, num_cached)

    def disk_hit_tokens(self, seq: CachedSequence, num_cached_tokens: int) -> int:
        """How many of the `num_cached_tokens` an admission found cached came from the disk tier (the rest were the
        pool's own): the part of the hit past the pool's own hit and within what the read brought in."""
        if seq.request_id not in self._loaded:
            return 0
        before, after = (n * self.block_size for n in self._loaded[seq.request_id])
        return max(0, min(num_cached_tokens, after) - before)

    def _finish_disk_load(self, load: _DiskLoad) -> int:
        """Blocks read up to the first miss join the prefix index; all go back to the pool (the unread uncached).
        Returns the prefix the pool now holds, in blocks."""
        num_loaded = load.read.finish()
        for block, block_load in zip(load.blocks[:num_loaded], load.read.loads):
            self.pool.register(block, block_load.key)
        self.pool.free(reversed(load.held + load.blocks))  # tail first, as a finished request frees
        longer = self._longest_prefix(self._lookup(load.hashes)).num_blocks
        self.disk.count_hit_tokens(max(0, longer - load.num_cached) * self.block_size)
        return longer

    def _disk_prefix_length(self, hashes: list[BlockHash], found: list[list[Block | None]], num_cached: int) -> int:
        """The longest prefix (in blocks) the pool and the disk hold together; the disk is asked past the pool's hit
        only (a stat per key, memoized)."""
        on_disk: dict[tuple[int, int], bool] = {}

        def held(g: int, i: int) -> bool:
            if found[g][i] is not None:
                return True
            if (i, g) not in on_disk:
                on_disk[i, g] = self.disk.contains(self._key(hashes[i], g))
            return on_disk[i, g]

        limit = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                limit = next((i for i in range(num_cached, limit) if not held(g, i)), limit)
        for num_blocks in range(limit, num_cached, -1):
            firsts = [self._first_needed(num_blocks, w) for w in self.windows]
            if all(held(g, i) for g, first in enumerate(firsts) for i in range(first, num_blocks)):
                return num_blocks
        return num_cached

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate(self, seq: CachedSequence, num_new_tokens: int, cached: CachedPrefix | None = None
                 ) -> list[BlockCopy] | None:
        """Make room in every group for `num_new_tokens` more tokens after the computed (and `cached`) ones.
        Returns the copies that copy-on-write needs, or None, changing nothing, if the pool is short."""
        new = seq.request_id not in self._tables
        tables = self._tables.setdefault(seq.request_id, [BlockTable() for _ in self.windows])
        hit = cached.num_blocks if cached else 0
        start = seq.num_computed_tokens + hit * self.block_size
        end_block = blocks_needed(start + num_new_tokens, self.block_size)
        # new blocks start after the held ones, or at the chunk's first block (after a hit, or when a sliding group
        # has dropped everything before it)
        first_new = [max(hit if hit else t.next_logical, start // self.block_size) for t in tables]
        num_new = [max(0, end_block - first) for first in first_new]
        shared = [self._shared_partial_block(t, start) if not hit else None for t in tables]
        hit_blocks = cached.all_blocks if cached else []
        reclaimed = len({b.block_id for b in hit_blocks if b.ref_cnt == 0})  # taking these empties free slots
        needed = sum(num_new) + sum(s is not None for s in shared)
        if needed > self.pool.num_free_blocks - reclaimed:
            if new:
                del self._tables[seq.request_id]
            return None
        copies = []
        for g, table in enumerate(tables):
            if hit:
                self.pool.touch(cached.blocks[g])
                table.extend(cached.blocks[g], cached.first_logical[g])
            if shared[g] is not None:
                new_block = self.pool.allocate(1)[0]
                copies.append(BlockCopy(table.blocks[shared[g]].block_id, new_block.block_id))
                self.pool.free([table.blocks[shared[g]]])
                table.blocks[shared[g]] = new_block
            table.extend(self.pool.allocate(num_new[g]), first_new[g])
        return copies

    def trim(self, seq: CachedSequence) -> None:
        """Give back the blocks past the sequence's computed tokens (speculative decoding: the blocks that only
        rejected draft tokens were written to). Slots of rejected tokens in a kept block are simply written again."""
        keep = blocks_needed(seq.num_computed_tokens, self.block_size)
        for table in self._tables.get(seq.request_id, []):
            cut = bisect.bisect_left(table.logical, keep)
            if cut < len(table.blocks):
                self.pool.free(reversed(table.drop(list(range(cut, len(table.blocks))))))

    def cache_full_blocks(self, seq: CachedSequence) -> None:
        """Register the blocks that became full since the last call, so later requests can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, self._exact_tokens(seq)) // self.block_size
        done = self._num_registered.get(seq.request_id, 0)
        if num_full <= done:  # the common decode step: the last block is still filling
            return
        hashes = self._block_hashes(seq, num_full * self.block_size)
        for g, table in enumerate(self._tables[seq.request_id]):
            # a sliding group may not hold every one of them (a prefix hit only brings its window)
            for i in range(bisect.bisect_left(table.logical, done), bisect.bisect_left(table.logical, num_full)):
                key = self._key(hashes[table.logical[i]], g)
                if self.pool.register(table.blocks[i], key) and self.disk is not None:
                    self._save_to_disk(seq, table.blocks[i], key, table.logical[i], hashes)
        self._num_registered[seq.request_id] = num_full

    def _save_to_disk(self, seq: CachedSequence, block: Block, key: BlockHash, number: int,
                      hashes: list[BlockHash]) -> None:
        """Hand a newly registered block to the disk tier, with its parent key and tokens for the reader to check."""
        self.disk.save(block.block_id, key, hashes[number - 1] if number else None, self._block_tokens(seq, number))

    def _block_tokens(self, seq: CachedSequence, number: int) -> list[int]:
        return seq.token_ids[number * self.block_size:(number + 1) * self.block_size]

    def drop_unneeded(self, seq: CachedSequence, scores: AttentionScores | None = None) -> None:
        """Drop the blocks no later query of `seq` reads: out of a sliding group's window, or what the eviction
        policy gives up. A block shared with another sequence only loses this sequence's reference."""
        tables = self._tables.get(seq.request_id)
        if tables is None:
            return
        position = seq.num_computed_tokens  # the next query
        for table, rule in zip(tables, self._window_rules):
            if rule is not None:
                first = position - position % self.block_size if self.tile_windows else position
                drop = rule.blocks_to_drop(table.logical, first, self.block_size)
                self.pool.free(table.drop(drop))
                self.num_window_blocks_freed += len(drop)
            elif self.eviction.evicts:
                block_scores = scores.block_scores([b.block_id for b in table.blocks]) if scores else None
                drop = self.eviction.blocks_to_drop(table.logical, position, self.block_size, block_scores)
                if drop:
                    self._first_eviction.setdefault(seq.request_id, position)
                    self.pool.free(table.drop(drop))
                    self.num_evicted_blocks += len(drop)

    def _exact_tokens(self, seq: CachedSequence) -> int:
        """Leading tokens whose K/V are what an uncompressed run computes: only their blocks may be shared."""
        limit = self.eviction.exact_tokens()
        first = self._first_eviction.get(seq.request_id)
        candidates = [n for n in (limit, first) if n is not None]
        return min(candidates) if candidates else seq.num_computed_tokens

    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """The child shares every parent block (copy-on-write when either writes into a shared one)."""
        tables = [t.copy() for t in self._tables.get(parent.request_id, [BlockTable() for _ in self.windows])]
        for table in tables:
            self.pool.touch(table.blocks)
        self._tables[child.request_id] = tables
        if parent.request_id in self._hashes:  # only computed blocks: the child's uncomputed tokens may differ
            computed = parent.num_computed_tokens // self.block_size
            self._hashes[child.request_id] = self._hashes[parent.request_id][:computed]
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)
        if parent.request_id in self._first_eviction:
            self._first_eviction[child.request_id] = self._first_eviction[parent.request_id]

    def free(self, seq: CachedSequence) -> None:
        """Return the request's blocks, tail first, so its head stays cached longest."""
        tables = self._tables.pop(seq.request_id, [])
        self._loaded.pop(seq.request_id, None)
        load = self._loads.pop(seq.request_id, None)
        if load is not None:  # aborted while its prefix was read: the reads are dropped (they write no block)
            self.pool.free(reversed(load.held + load.blocks))
        self._hashes.pop(seq.request_id, None)
        self._num_registered.pop(seq.request_id, None)
        self._first_eviction.pop(seq.request_id, None)
        for table in tables:
            self.pool.free(reversed(table.blocks))

    def _first_needed(self, num_blocks: int, window: int | None) -> int:
        """The first block a group must hold to continue after `num_blocks` cached ones."""
        if window is None:
            return 0
        return min(num_blocks, max(0, num_blocks * self.block_size - window + 1) // self.block_size)

    def _key(self, block_hash: BlockHash, group: int) -> BlockHash:
        """Each layer group caches its own blocks of a prefix."""
        return block_hash if self.num_groups == 1 else block_hash + bytes([group])

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
