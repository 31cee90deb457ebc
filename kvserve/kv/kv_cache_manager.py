"""Per-request block tables on top of the block pool: allocate, grow, share (prefix hits, forks), copy on write,
drop what a sliding window or an eviction policy no longer reads, free.

A request has one block table per layer group of the model's KVLayout, kept by that group's manager
(group_managers.py: full attention, sliding window, evicting). The coordinator here holds what the groups share:
the pool, the requests' block hashes and their registration in the prefix index, the counters and the disk tier's
loads (disk_loads.py), and calls the group managers to find a prefix hit, allocate, drop unneeded blocks and free.
A hybrid model's linear layers keep a state slot per sequence instead of blocks (state_cache.py: StateSlots),
taken with the first blocks, freed and forked with them; its hits resume only after a state checkpoint (resume.py:
CheckpointEnds, the policy chosen here once)."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.block_table import BlockCopy, BlockTable, CachedPrefix, CachedSequence, blocks_needed
from kvserve.kv.disk_loads import DiskLoads
from kvserve.kv.eviction import AttentionScores, EvictionPolicy
from kvserve.kv.group_managers import make_group_managers
from kvserve.kv.prefix_lookup import PrefixLookup, RequestHashes
from kvserve.kv.resume import BlockEnds, CheckpointEnds
from kvserve.kv.state_cache import StateCheckpoints, StateSlots

if TYPE_CHECKING:
    from kvserve.kv.tiers.base import KVTier

# the engine imports the block-table types from here
__all__ = ["BlockCopy", "BlockTable", "CachedPrefix", "KVCacheManager", "blocks_needed"]


class KVCacheManager:
    """The coordinator: one block pool and prefix index under the layer groups' managers, one request at a time."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_namespace: str = "",
                 eviction: EvictionPolicy | None = None, windows: Sequence[int | None] = (None,),
                 tile_windows: bool = False, disk: KVTier | None = None, state_slots: int | None = None,
                 state_checkpoints: int = 0):
        if state_slots is not None and enable_prefix_caching and not state_checkpoints:
            raise ValueError("prefix caching with state slots (a hybrid model) needs state checkpoints: a KV hit "
                             "without the linear layers' state at its end cannot resume")
        self.block_size = block_size
        self.hash_namespace = hash_namespace  # blocks of another storage format can never be hits
        self.eviction = eviction or EvictionPolicy()
        self.windows = tuple(windows)  # per layer group: None for full attention, else its sliding window
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # tile_windows: batch-invariant attention reads, for a query tile (one block), its first position's window
        self.groups = make_group_managers(self.pool, block_size, self.windows, self.eviction, tile_windows)
        self._hashes = RequestHashes(block_size, hash_namespace)
        self._prefixes = PrefixLookup(self.pool, self.groups)
        # hybrid models: each sequence's state slot (linear-attention layers), None for attention-only models
        self.state = StateSlots(state_slots) if state_slots is not None else None
        # their checkpoints at block boundaries, in the state cache's slots after the running ones
        self.checkpoints = (StateCheckpoints(state_slots, state_checkpoints, self._holds_block, self.state.copies_from)
                            if self.state and state_checkpoints else None)
        self._resume = (CheckpointEnds(self.checkpoints, self._prefixes, self._hashes, disk)
                        if self.checkpoints is not None else BlockEnds())
        self._disk = DiskLoads(self.pool, block_size, disk, self._prefixes, self._hashes, self._resume)
        self._empty_prefix = self._no_prefix()  # what allocate takes without a hit (read only)
        self._num_registered: dict[str, int] = {}  # leading blocks of each sequence already in the prefix index
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_evicted_blocks(self) -> int:
        """Blocks dropped by the eviction policy."""
        return sum(group.num_evicted_blocks for group in self.groups)

    @property
    def num_window_blocks_freed(self) -> int:
        """Blocks dropped by sliding-window groups."""
        return sum(group.num_window_blocks_freed for group in self.groups)

    def block_ids(self, request_id: str) -> list[int]:
        """Every block the request holds, all layer groups."""
        return [b.block_id for group in self.groups for b in group.table(request_id).blocks]

    def block_table(self, request_id: str, group: int = 0) -> BlockTable:
        return self.groups[group].table(request_id)

    def num_allocated_slots(self, request_id: str) -> int:
        return len(self.block_ids(request_id)) * self.block_size

    def num_stored_tokens(self, seq: CachedSequence, group: int = 0) -> int:
        """Tokens of `seq` whose K/V one layer group holds (computed ones, minus those in dropped blocks)."""
        return self.groups[group].num_stored_tokens(seq)

    def num_wasted_slots(self, seq: CachedSequence) -> int:
        """Slots `seq` holds that hold no token (the unfilled end of each group's last block)."""
        return sum(len(group.table(seq.request_id).blocks) * self.block_size - group.num_stored_tokens(seq)
                   for group in self.groups)

    def find_cached_prefix(self, seq: CachedSequence) -> CachedPrefix:
        """Longest cached prefix of whole blocks whose full groups hold all of it and whose sliding groups hold
        the window before its end; the last token is always left to compute."""
        if not self.pool.enable_prefix_caching:
            return self._no_prefix()
        hashes = self._hashes.prompt_hashes(seq)
        return self._resume.cut(hashes, self._prefixes.longest_prefix(self._prefixes.lookup(hashes)))

    def checkpoint_boundaries(self, seq: CachedSequence, num_prompt_tokens: int, start: int, end: int
                              ) -> list[tuple[int, str]]:
        """Where a step computing `seq`'s tokens `start` to `end` saves its state (resume.py:
        CheckpointEnds.boundaries); none without checkpoints."""
        return self._resume.boundaries(seq, num_prompt_tokens, start, end)

    def plan_checkpoint(self, seq: CachedSequence, num_tokens: int, kind: str, saved_now: bool = False
                        ) -> int | None:
        """A checkpoint slot to save `seq`'s state after its first `num_tokens` tokens (a block boundary of `kind`,
        as checkpoint_boundaries gives it) in; None if there is none to save (resume.py: CheckpointEnds.plan). Of
        the checkpoints taken while decoding, a sequence keeps its newest."""
        return self._resume.plan(seq, num_tokens, kind, saved_now)

    def _holds_block(self, block_hash: bytes) -> bool:
        """Whether the pool holds the block of `block_hash` in every layer group (a checkpoint after it is usable)."""
        return all(self.pool.lookup(self._prefixes.key(block_hash, g)) is not None for g in range(self.num_groups))

    def _no_prefix(self) -> CachedPrefix:
        return CachedPrefix(blocks=[[] for _ in self.groups], first_logical=[0] * self.num_groups)

    def prefix_loading(self, seq: CachedSequence) -> bool:
        """Whether `seq` waits for its prefix to be read from the disk tier (see DiskLoads.prefix_loading)."""
        return self._disk.prefix_loading(seq)

    def collect_loads(self) -> None:
        """Put the finished disk reads' blocks into the pool's prefix index (on the step thread)."""
        self._disk.collect_loads()

    def wait_for_loads(self, timeout_s: float) -> None:
        """With nothing else to run: wait up to `timeout_s` for a disk read to finish (none pending: return)."""
        self._disk.wait_for_loads(timeout_s)

    def disk_hit_tokens(self, seq: CachedSequence, num_cached_tokens: int) -> int:
        """How many of the `num_cached_tokens` an admission found cached came from the disk tier."""
        return self._disk.disk_hit_tokens(seq, num_cached_tokens)

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate(self, seq: CachedSequence, num_new_tokens: int, cached: CachedPrefix | None = None
                 ) -> list[BlockCopy] | None:
        """Make room in every group for `num_new_tokens` more tokens after the computed (and `cached`) ones.
        Returns the copies that copy-on-write needs, or None, changing nothing, if the pool is short. An admission
        passes its prefix hit (`cached`), a running sequence's later chunk none."""
        admission, cached = cached is not None, cached or self._empty_prefix
        hit = cached.num_blocks
        start = seq.num_computed_tokens + hit * self.block_size
        end_block = blocks_needed(start + num_new_tokens, self.block_size)
        growths = [group.plan_growth(seq.request_id, hit, start, end_block) for group in self.groups]
        reclaimed = len({b.block_id for b in cached.all_blocks if b.ref_cnt == 0})  # taking these empties free slots
        if sum(growth.num_blocks for growth in growths) > self.pool.num_free_blocks - reclaimed:
            return None
        if self.state is not None:
            if not self.state.can_take(seq.request_id):
                return None
            if cached.state_checkpoint is not None:
                self.state.restore(seq.request_id, cached.state_checkpoint)
                self.checkpoints.hit(cached.state_checkpoint)
            self.state.take(seq.request_id)
        if admission:
            self._resume.admitted(seq, cached)
        # every group holds its hit before any group takes new blocks: those come off the front of the free queue,
        # where another group's unreferenced cached blocks wait (taken, they would be written while served as its
        # prefix)
        for g, group in enumerate(self.groups):
            group.take_cached(seq.request_id, cached.blocks[g], cached.first_logical[g])
        copies = []
        for group, growth in zip(self.groups, growths):
            copies += group.grow(seq.request_id, growth)
        return copies

    def trim(self, seq: CachedSequence) -> None:
        """Give back the blocks past the sequence's computed tokens (speculative decoding: the blocks that only
        rejected draft tokens were written to). Slots of rejected tokens in a kept block are simply written again."""
        for group in self.groups:
            group.trim(seq.request_id, seq.num_computed_tokens)
        self._resume.trimmed(seq)

    def cache_full_blocks(self, seq: CachedSequence) -> None:
        """Register the blocks that became full since the last call, so later requests can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, self._exact_tokens(seq)) // self.block_size
        done = self._num_registered.get(seq.request_id, 0)
        if num_full <= done:  # the common decode step: the last block is still filling
            return
        hashes = self._hashes.block_hashes(seq, num_full * self.block_size)
        for g, group in enumerate(self.groups):
            table = group.tables[seq.request_id]
            # a sliding group may not hold every one of them (a prefix hit only brings its window)
            for i in range(bisect.bisect_left(table.logical, done), bisect.bisect_left(table.logical, num_full)):
                key = self._prefixes.key(hashes[table.logical[i]], g)
                if self.pool.register(table.blocks[i], key):
                    self._disk.save(seq, table.blocks[i], key, table.logical[i], hashes)
        self._resume.registered(seq, hashes, done, num_full)
        self._num_registered[seq.request_id] = num_full

    def drop_unneeded(self, seq: CachedSequence, scores: AttentionScores | None = None) -> None:
        """Drop the blocks no later query of `seq` reads: out of a sliding group's window, or what the eviction
        policy gives up. A block shared with another sequence only loses this sequence's reference."""
        for group in self.groups:
            group.drop_unneeded(seq, scores)

    def _exact_tokens(self, seq: CachedSequence) -> int:
        """Leading tokens whose K/V are what an uncompressed run computes: only their blocks may be shared."""
        candidates = [n for group in self.groups if (n := group.exact_tokens(seq.request_id)) is not None]
        return min(candidates) if candidates else seq.num_computed_tokens

    def fork(self, parent: CachedSequence, child: CachedSequence) -> None:
        """The child shares every parent block (copy-on-write when either writes into a shared one) and gets a copy
        of its state slot (hybrid models)."""
        if self.state is not None:  # first: it refuses when no slot is free, before any block is shared
            self.state.fork(parent.request_id, child.request_id)
        for group in self.groups:
            group.fork(parent.request_id, child.request_id)
        self._hashes.fork(parent, child)
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def free(self, seq: CachedSequence) -> None:
        """Return the request's blocks, tail first, so its head stays cached longest."""
        self._disk.free(seq.request_id)
        self._resume.freed(seq)  # before its hashes go: a hybrid's newest decode checkpoint is kept
        self._hashes.free(seq.request_id)
        self._num_registered.pop(seq.request_id, None)
        if self.state is not None:
            self.state.free(seq.request_id)
        for group in self.groups:
            group.free(seq.request_id)
