"""The KV cache manager's side of the disk tier: registered blocks are handed to it, and a prompt whose prefix the
disk holds more of than the pool waits while reader threads read it into pool blocks, which then join the prefix
index for the admission's lookup to find. Where a hit may resume is the manager's policy (resume.py): a hybrid
model's read ends with the deepest state checkpoint usable with the blocks read, and reads no block past it."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.block_table import CachedSequence
from kvserve.kv.prefix_lookup import PrefixLookup, RequestHashes
from kvserve.kv.resume import BlockEnds
from kvserve.kv.tiers.base import BlockLoad

if TYPE_CHECKING:
    from kvserve.kv.tiers.base import KVTier, TierRead


@dataclass(frozen=True)
class _DiskLoad:
    """A prefix being read from the disk tier: the read, the pool blocks it fills and the pool's hits it holds."""

    read: TierRead
    blocks: list[Block]
    held: list[Block]
    hashes: list[BlockHash]
    num_cached: int  # the pool's own hit, in blocks (where a hit may resume)


class DiskLoads:
    """Prefixes being read from the disk tier (by request), and what each admission's hit owes to it. Without a disk
    tier nothing loads and nothing is saved."""

    def __init__(self, pool: BlockPool, block_size: int, disk: KVTier | None, prefixes: PrefixLookup,
                 hashes: RequestHashes, resume: BlockEnds):
        self.pool = pool
        self.block_size = block_size
        self.disk = disk  # a lower tier: registered blocks are written there, and lookups continue there
        if disk is not None:  # which block holds a key now: a block the writer skipped is written later from there
            disk.attach_pool(lambda key: block.block_id if (block := self.pool.lookup(key)) is not None else None)
        self.prefixes = prefixes
        self.hashes = hashes
        self.resume = resume  # where a hit may resume: after any block, or after a state checkpoint (hybrids)
        self._loads: dict[str, _DiskLoad] = {}  # by request: prefixes being read from the disk tier
        # requests waiting for admission whose prefix was read already: the pool's hit before the read and the
        # prefix the pool held after it, in blocks (what admission's hit owes to the disk tier)
        self._loaded: dict[str, tuple[int, int]] = {}

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
        hashes = self.hashes.prompt_hashes(seq)
        found = self.prefixes.lookup(hashes)
        prefix = self.prefixes.longest_prefix(found)
        num_cached = self.resume.cut(hashes, prefix).num_blocks
        if num_cached < len(hashes):
            load = self._start_disk_load(seq, hashes, found, prefix.num_blocks, num_cached)
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

    def disk_hit_tokens(self, seq: CachedSequence, num_cached_tokens: int) -> int:
        """How many of the `num_cached_tokens` an admission found cached came from the disk tier (the rest were the
        pool's own): the part of the hit past the pool's own hit and within what the read brought in."""
        if seq.request_id not in self._loaded:
            return 0
        before, after = (n * self.block_size for n in self._loaded[seq.request_id])
        return max(0, min(num_cached_tokens, after) - before)

    def save(self, seq: CachedSequence, block: Block, key: BlockHash, number: int, hashes: list[BlockHash]) -> None:
        """Hand a newly registered block to the disk tier, with its parent key and tokens for the reader to check."""
        if self.disk is not None:
            self.disk.save(block.block_id, key, hashes[number - 1] if number else None, self._block_tokens(seq, number))

    def free(self, request_id: str) -> None:
        """Forget the request; aborted while its prefix was read, the reads are dropped (they write no block)."""
        self._loaded.pop(request_id, None)
        load = self._loads.pop(request_id, None)
        if load is not None:
            self.pool.free(reversed(load.held + load.blocks))

    def _start_disk_load(self, seq: CachedSequence, hashes: list[BlockHash], found: list[list[Block | None]],
                         num_pool: int, num_cached: int) -> _DiskLoad | None:
        """Start reading what the deepest block end a hit may resume after, in the prefix the pool (`num_pool`
        blocks) and the disk hold together, needs past the pool's resumable hit of `num_cached` blocks, into pool
        blocks taken now; None if the disk adds nothing the pool has room for."""
        ends = self.resume.ends(hashes, num_cached, self._disk_prefix_length(hashes, found, num_pool))
        num_blocks = ends[0] if ends else 0
        firsts = self.prefixes.first_needed(num_blocks)
        wanted = sorted((i, g) for g, first in enumerate(firsts) for i in range(first, num_blocks)
                        if found[g][i] is None)
        # the pool's own hits are held while the read runs, so taking blocks cannot evict them
        held = [b for g, first in enumerate(firsts) for b in found[g][first:num_blocks] if b is not None]
        self.pool.touch(held)
        # the ends there is room to read the blocks before (wanted is sorted: those before n come first)
        ends = [n for n in ends if bisect.bisect_left(wanted, (n, 0)) <= self.pool.num_free_blocks]
        wanted = wanted[: self.pool.num_free_blocks]
        states = self.resume.state_loads(seq, hashes, ends, wanted)
        num_states = sum(not state.held for state in states[:1])
        if not ends or not self.disk.worth_reading(len(wanted), (ends[0] - num_cached) * self.block_size,
                                                     num_states):
            self.pool.free(reversed(held))
            return None
        blocks = self.pool.allocate(len(wanted))
        loads = [BlockLoad(block.block_id, self.prefixes.key(hashes[i], g), hashes[i - 1] if i else None,
                           self._block_tokens(seq, i)) for block, (i, g) in zip(blocks, wanted)]
        return _DiskLoad(self.disk.start_reading(loads, states), blocks, held, hashes, num_cached)

    def _finish_disk_load(self, load: _DiskLoad) -> int:
        """Blocks read up to the first miss join the prefix index; all go back to the pool (the unread uncached).
        Returns the prefix the pool now holds, in blocks."""
        num_loaded = load.read.finish()
        for block, block_load in zip(load.blocks[:num_loaded], load.read.loads):
            self.pool.register(block, block_load.key)
        self.resume.finish(load.read, load.hashes)
        self.pool.free(reversed(load.held + load.blocks))  # tail first, as a finished request frees
        prefix = self.prefixes.longest_prefix(self.prefixes.lookup(load.hashes))
        longer = self.resume.cut(load.hashes, prefix).num_blocks
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
                on_disk[i, g] = self.disk.contains(self.prefixes.key(hashes[i], g))
            return on_disk[i, g]

        return self.prefixes.longest_held(held, num_cached, len(hashes))

    def _block_tokens(self, seq: CachedSequence, number: int) -> list[int]:
        return seq.token_ids[number * self.block_size:(number + 1) * self.block_size]
