"""Where a prefix hit may resume, one policy per kind of model, chosen once by the KV cache manager: after any cached
block (BlockEnds: attention-only models), or only after a block with a state checkpoint (CheckpointEnds: hybrid
models, whose linear layers need their state there). The disk tier's loads (disk_loads.py) ask the same policy which
block ends a read may reach and what it must read besides the blocks."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.block_table import CachedPrefix, CachedSequence
from kvserve.kv.prefix_lookup import PrefixLookup, RequestHashes
from kvserve.kv.state_cache import StateCheckpoints
from kvserve.kv.tiers.base import StateLoad

if TYPE_CHECKING:
    from kvserve.kv.tiers.base import KVTier, TierRead

Wanted = Sequence[tuple[int, int]]  # the blocks a read brings, (logical index, group), in order
CHECKPOINT_INTERVAL_TOKENS = 256  # hybrid models: a prompt saves its state at least this often (whole blocks)
# why a checkpoint is saved where it is (CheckpointEnds.boundaries), most valuable first
PROMPT_END, BRANCH, INTERVAL, DECODE = "prompt end", "branch point", "interval", "decode"


class BlockEnds:
    """Attention-only models: a hit resumes after any block whose layer groups hold what they need."""

    def cut(self, hashes: list[BlockHash], prefix: CachedPrefix) -> CachedPrefix:
        return prefix

    def ends(self, hashes: list[BlockHash], num_usable: int, num_held: int) -> list[int]:
        """The block ends past `num_usable` a read of the prefix the pool and tier hold (`num_held` blocks) may
        resume after, deepest first."""
        return list(range(num_held, num_usable, -1))

    def state_loads(self, seq: CachedSequence, hashes: list[BlockHash], ends: list[int],
                    wanted: Wanted) -> list[StateLoad]:
        return []

    def finish(self, read: TierRead, hashes: list[BlockHash]) -> None:
        """A read is done and its blocks are in the pool: nothing else to put in place."""

    def registered(self, seq: CachedSequence, hashes: list[BlockHash], first: int, end: int) -> None:
        """Blocks `first` to `end` of `seq` are registered: nothing else to keep."""

    def freed(self, seq: CachedSequence) -> None:
        """`seq` is freed (finished, aborted or preempted)."""

    def trimmed(self, seq: CachedSequence) -> None:
        """`seq` gave back the blocks past its computed tokens."""

    def admitted(self, seq: CachedSequence, cached: CachedPrefix) -> None:
        """`seq` starts after `cached`: nothing else to remember."""

    def boundaries(self, seq: CachedSequence, num_prompt_tokens: int, start: int, end: int) -> list[tuple[int, str]]:
        """Where a step saves `seq`'s state: nowhere, there is none."""
        return []


class CheckpointEnds(BlockEnds):
    """Hybrid models: a hit resumes only after a block with a state checkpoint (state_cache.py: StateCheckpoints),
    the deepest one inside the KV hit. Checkpoints are planned at block boundaries a step passes anyway
    (`boundaries`, then `plan` for each); a decoding sequence keeps its newest. With a disk tier, a prompt's end
    or branch point goes to disk with its block, and a sequence's newest decode checkpoint when it is freed (where
    its conversation resumes); a read from the tier ends with the deepest checkpoint usable with the blocks read."""

    def __init__(self, checkpoints: StateCheckpoints, prefixes: PrefixLookup, hashes: RequestHashes,
                 disk: KVTier | None):
        self.checkpoints = checkpoints
        self.prefixes = prefixes
        self.hashes = hashes
        self.disk = disk
        if disk is not None:  # which slot holds a checkpoint now: one the writer skipped is written later from there
            disk.attach_checkpoints(checkpoints.saved_slot)
        self.block_size = hashes.block_size
        # each sequence's newest checkpoint taken while decoding, and its depth in blocks
        self._decoding: dict[str, tuple[BlockHash, int]] = {}
        # the checkpoints a sequence planned whose block is not registered yet, and why each was planned
        self._unfilled: dict[str, dict[BlockHash, str]] = {}
        # where a sequence's KV hit ended when it had to resume before it (no checkpoint there): a prefix that
        # another prompt shares, so the next prompt sharing it may resume there
        self._branches: dict[str, int] = {}
        self.interval = max(1, CHECKPOINT_INTERVAL_TOKENS // self.block_size) * self.block_size

    def cut(self, hashes: list[BlockHash], prefix: CachedPrefix) -> CachedPrefix:
        """The hit cut back to the deepest block end inside it with a checkpoint, whose groups hold what they need
        to continue after it (a sliding group's window before a shallower end may be gone)."""
        for num_blocks in range(prefix.num_blocks, 0, -1):
            slot = self.checkpoints.lookup(hashes[num_blocks - 1])
            if slot is None:
                continue
            cut = self.prefixes.longest_prefix(self.prefixes.lookup(hashes[:num_blocks]))
            if cut.num_blocks == num_blocks:
                cut.state_checkpoint, cut.held_blocks = slot, prefix.num_blocks
                return cut
        return CachedPrefix(blocks=[[] for _ in self.prefixes.groups], first_logical=[0] * len(self.prefixes.groups),
                            held_blocks=prefix.num_blocks)

    def admitted(self, seq: CachedSequence, cached: CachedPrefix) -> None:
        """`seq` resumes after `cached`; if the pool held more of its prompt, that hit's end is a branch point."""
        if cached.held_blocks > cached.num_blocks:
            self._branches[seq.request_id] = cached.held_blocks * self.block_size
        else:
            self._branches.pop(seq.request_id, None)

    def boundaries(self, seq: CachedSequence, num_prompt_tokens: int, start: int, end: int) -> list[tuple[int, str]]:
        """The block boundaries in (`start`, `end`] where `seq`'s step saves its state, most valuable first, each
        with why. In a prompt: its last block boundary that a hit can use (PROMPT_END: a later prompt computes at
        least its last token), the end of the KV hit it found deeper than any checkpoint (BRANCH: a prefix another
        prompt shares, where the next one sharing it resumes), and every `interval` tokens, deepest first
        (INTERVAL: a prompt's next sharer resumes within `interval` of where they part). At or past the prompt's
        end, a chunk's end on a block boundary (DECODE, of which a sequence keeps its newest: where the next turn
        of a conversation resumes, the prompt's end when it fills its last block, then each boundary reached while
        decoding; a finished sequence keeps the end of its last full block)."""
        bs = self.block_size
        prompt_boundary = (num_prompt_tokens - 1) // bs * bs
        last = min(end, prompt_boundary)
        inside = [(prompt_boundary, PROMPT_END), (self._branches.get(seq.request_id, 0), BRANCH)]
        inside += [(b, INTERVAL) for b in range(last // self.interval * self.interval, start, -self.interval)]
        boundaries = []
        for b, kind in inside:  # a boundary of two kinds is saved as the more valuable
            if start < b <= last and b not in dict(boundaries):
                boundaries.append((b, kind))
        if end % bs == 0 and end >= num_prompt_tokens:
            boundaries.append((end, DECODE))
        return boundaries

    def plan(self, seq: CachedSequence, num_tokens: int, kind: str, saved_now: bool = False) -> int | None:
        """A checkpoint slot to save `seq`'s state after its first `num_tokens` tokens (a block boundary, of `kind`:
        `boundaries`) in; None if one is saved there already, the boundary lies among draft tokens (not known to be
        kept), or every slot waits for its step. `saved_now`: the caller saves the state before the next step and
        the block is already registered (a verified draft passed the boundary), so the checkpoint counts as filled
        at once."""
        decoding = kind == DECODE
        num_blocks = num_tokens // self.block_size
        if num_tokens > len(seq.token_ids):
            return None
        key = self.hashes.block_hashes(seq, num_tokens)[num_blocks - 1]
        if self.checkpoints.contains(key):
            return None
        if decoding:  # the older one first: its slot is the one to take
            old = self._decoding.pop(seq.request_id, None)
            if old is not None:
                self._give_back(seq, old[0])
        slot = self.checkpoints.take(key, num_blocks, hits=int(kind == BRANCH))
        if slot is None:
            return None
        if decoding:
            self._decoding[seq.request_id] = key, num_blocks
        if saved_now:
            self.checkpoints.filled(key)
        else:
            self._unfilled.setdefault(seq.request_id, {})[key] = kind
        return slot

    def _give_back(self, seq: CachedSequence, key: BlockHash) -> None:
        self._unfilled.get(seq.request_id, {}).pop(key, None)
        self.checkpoints.release(key)

    def ends(self, hashes: list[BlockHash], num_usable: int, num_held: int) -> list[int]:
        """Block ends past `num_usable` inside the held prefix with a checkpoint in memory or on the tier."""
        return [n for n in range(num_held, num_usable, -1)
                if self.checkpoints.contains(hashes[n - 1]) or self.disk.contains_state(hashes[n - 1])]

    def state_loads(self, seq: CachedSequence, hashes: list[BlockHash], ends: list[int],
                    wanted: Wanted) -> list[StateLoad]:
        """The checkpoints a read may end with, deepest first: each usable once the blocks before it are read."""
        indices = [i for i, _ in wanted]
        return [StateLoad(hashes[n - 1], hashes[n - 2] if n > 1 else None, self._tokens(seq, n - 1),
                          bisect.bisect_left(indices, n), self.checkpoints.contains(hashes[n - 1])) for n in ends]

    def finish(self, read: TierRead, hashes: list[BlockHash]) -> None:
        """Put the checkpoint read, if any, in a checkpoint slot (its blocks are in the pool now)."""
        state = read.state
        if state is None or self.checkpoints.contains(state.key):
            return
        slot = self.checkpoints.take(state.key, hashes.index(state.key) + 1)
        if slot is not None:
            read.put_state(slot)
            self.checkpoints.filled(state.key)

    def registered(self, seq: CachedSequence, hashes: list[BlockHash], first: int, end: int) -> None:
        """The checkpoints `seq` planned in blocks `first` to `end` are saved (their step ran): evictable from now
        on, and a prompt's end or a branch point goes to the tier with its block (an interval checkpoint stays in
        memory: a state costs the tier as much as many blocks, and most are never hit)."""
        unfilled = self._unfilled.get(seq.request_id, {})
        for i in range(first, end):
            kind = unfilled.pop(hashes[i], None)
            if kind is not None:
                self.checkpoints.filled(hashes[i])
                if kind in (PROMPT_END, BRANCH):
                    self._save(seq, hashes, i + 1)

    def freed(self, seq: CachedSequence) -> None:
        """A freed sequence's newest decode checkpoint goes to the tier (the next turn resumes there); checkpoints
        whose step never registered their block are given back."""
        key, num_blocks = self._decoding.pop(seq.request_id, (None, 0))
        unfilled = self._unfilled.pop(seq.request_id, {})
        self._branches.pop(seq.request_id, None)
        if key is not None and self.checkpoints.contains(key) and key not in unfilled:
            self._save(seq, self.hashes.block_hashes(seq, num_blocks * self.block_size), num_blocks)
        for key in unfilled:
            self.checkpoints.release(key)

    def trimmed(self, seq: CachedSequence) -> None:
        """Checkpoints planned past the computed tokens (rejected draft tokens) are given back."""
        computed = self.hashes.block_hashes(seq, seq.num_computed_tokens)
        for key in [k for k in self._unfilled.get(seq.request_id, {}) if k not in computed]:
            self._give_back(seq, key)
            if self._decoding.get(seq.request_id, (None,))[0] == key:
                del self._decoding[seq.request_id]

    def _save(self, seq: CachedSequence, hashes: list[BlockHash], num_blocks: int) -> None:
        """Hand the tier the checkpoint after block `num_blocks` - 1 of `seq`."""
        if self.disk is None:
            return
        key = hashes[num_blocks - 1]
        self.disk.save_state(self.checkpoints.lookup(key), key, hashes[num_blocks - 2] if num_blocks > 1 else None,
                             self._tokens(seq, num_blocks - 1))

    def _tokens(self, seq: CachedSequence, number: int) -> list[int]:
        return seq.token_ids[number * self.block_size:(number + 1) * self.block_size]
