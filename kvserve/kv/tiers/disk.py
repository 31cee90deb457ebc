"""The disk tier below the pool: full prefix blocks kept as files, so a prefix outlives the pool's LRU and the process.

What is stored: each block the prefix index registers (never one an eviction policy changed: those are never
registered), exactly as the pool holds it (`PagedKVCache.export_block`: every tensor of its format, every layer of
its group), one record per block and layer group (record.py), named sha256(model fingerprint, block key). The key
chains through the whole prefix, with the storage format and cache_salt in its root (kv/block_hash.py), so a record
is found only by the same model, format and tenant. Writes go through the store's writer thread (store.py); a block
the writer has no room for is handed again later, from the pool, and at a clean exit. Reads start on admission and
run on reader threads while the steps go on (chain_read.py); the request waits, and its blocks join the pool's prefix
index once read. A hybrid model's state checkpoint (kv/state_cache.py) is kept beside the block it ends, a record
of its own kind under the same key (`save_state`); a prefix read then ends with the deepest checkpoint usable with
the blocks read, read and checked like them. Whether to read at all is the cost model's call (cost.py). Whatever
goes wrong on a read is a miss at this boundary, counted by kind, never an exception in the engine's step; a read
that takes longer than READ_TIMEOUT_S is abandoned as a miss, and its reader thread (a daemon) left to end when it
can."""
from __future__ import annotations

import atexit
import logging
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import torch

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.state_cache import StateCache
from kvserve.kv.tiers.base import BlockLoad, StateLoad
from kvserve.kv.tiers.chain_read import ChainRead
from kvserve.kv.tiers.cost import ReadCost
from kvserve.kv.tiers.readers import ReaderThreads, ReadJob
from kvserve.kv.tiers.record import BLOCK, STATE, BlockRecord, RecordKind, RecordRejected
from kvserve.kv.tiers.store import EXIT_FLUSH_S, DiskBlockStore

logger = logging.getLogger("kvserve")

READ_THREADS = 2  # prefixes read at once; each prefix's records are read in order on one thread (see DiskKVCache)
# A prefix read not done this long after it started is abandoned: the request is prefilled as if the tier lacked it
# (a read of a healthy disk's records takes a small fraction of this; a stuck one would hold the request forever).
READ_TIMEOUT_S = 30.0
MAX_SKIPPED = 1 << 16  # skipped blocks remembered to hand again (a key, parent and 16 token ids each)


class DiskKVCache:
    """The disk tier as the KV cache manager sees it (base.py:KVTier): pool blocks in and out by key, the store's
    files below."""

    def __init__(self, store: DiskBlockStore, cache: PagedKVCache, state_cache: StateCache | None = None):
        self.store = store
        self.cache = cache
        self.state_cache = state_cache  # hybrid models: the state slots whose checkpoints are kept too
        # Blocks skipped while the writer was behind: handed again once it has room, if the pool still holds them
        # (`_pool_block` says which pool block holds a key now: the KV cache manager attaches it), and at a clean exit.
        self._skipped: OrderedDict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = OrderedDict()
        self._pool_block: Callable[[BlockHash], int | None] = lambda key: None
        # the same for state checkpoints, written later from the checkpoint slot that still holds one
        self._skipped_states: OrderedDict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = OrderedDict()
        self._checkpoint_slot: Callable[[BlockHash], int | None] = lambda key: None
        self.specs = cache.block_specs()
        self.num_hit_tokens = 0  # prompt tokens whose blocks came from disk (the KV manager counts them)
        self.record_bytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.specs)
        self.state_specs = state_cache.slot_specs() if state_cache is not None else []
        self.state_bytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.state_specs)
        self.cost = ReadCost()
        # One thread reads one prefix's records in order, after asking the kernel to read all its files ahead
        # (posix_fadvise WILLNEED: the disk sees them all at once). Several threads per prefix were slower: most
        # of a record's time out of the page cache is Python holding the GIL, and threads only contend for it.
        self._readers = ReaderThreads(READ_THREADS, "kvserve-disk-reader")
        atexit.register(_flush_tier_at_exit, weakref.ref(self))

    def attach_pool(self, find_block: Callable[[BlockHash], int | None]) -> None:
        """`find_block` says which pool block holds a key now: a block the writer skipped is written later from
        there (the KV cache manager attaches its pool once)."""
        self._pool_block = find_block

    def attach_checkpoints(self, find_slot: Callable[[BlockHash], int | None]) -> None:
        """`find_slot` says which state slot holds the checkpoint saved under a key now: a checkpoint the writer
        skipped is written later from there (hybrid models' checkpoint manager attaches it)."""
        self._checkpoint_slot = find_slot

    def contains(self, key: BlockHash) -> bool:
        return self.store.contains(key)

    def count_hit_tokens(self, num_tokens: int) -> None:
        """Prompt tokens whose blocks came from disk (the KV cache manager counts them)."""
        self.num_hit_tokens += num_tokens

    def save(self, block_id: int, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Copy a newly registered full block out of the pool for the writer (a memcpy on the step thread). A block
        the writer had no room for is remembered and handed again later (`save_skipped`)."""
        if self.store.writing_stopped:
            return
        if self._skipped or self._skipped_states:
            self.save_skipped()
        if not self.store.submit(BlockRecord(key, parent, tuple(token_ids), self.cache.export_block(block_id))) \
                and len(self._skipped) < MAX_SKIPPED:
            self._skipped[key] = (parent, tuple(token_ids))

    def save_state(self, slot: int, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Copy the state checkpoint in state slot `slot` out for the writer: the state after the block of `key`.
        One the writer has no room for is handed again later, as a block is, while a checkpoint slot still holds
        it (`save_skipped`)."""
        if self.store.writing_stopped or self.state_cache is None or self.store.contains(key, STATE):
            return
        record = BlockRecord(key, parent, tuple(token_ids), self.state_cache.export_slot(slot), STATE)
        if not self.store.submit(record) and len(self._skipped_states) < MAX_SKIPPED:
            self._skipped_states[key] = (parent, tuple(token_ids))

    def contains_state(self, key: BlockHash) -> bool:
        return self.state_cache is not None and self.store.contains(key, STATE)

    def save_skipped(self, timeout_s: float = 0.0) -> None:
        """Hand the writer the skipped blocks the pool still holds, oldest first, then the skipped checkpoints a
        checkpoint slot still holds, while it has room (waiting up to `timeout_s` for room). What is no longer
        held cannot be written: it is forgotten."""
        deadline = time.monotonic() + timeout_s
        if self._hand_again(self._skipped, self._pool_block, self.record_bytes, self.cache.export_block, BLOCK,
                            deadline) and self.state_cache is not None:
            self._hand_again(self._skipped_states, self._checkpoint_slot, self.state_bytes,
                             self.state_cache.export_slot, STATE, deadline)

    def _hand_again(self, skipped: OrderedDict, find: Callable[[BlockHash], int | None], num_bytes: int,
                    export: Callable[[int], list[torch.Tensor]], kind: RecordKind, deadline: float) -> bool:
        """save_skipped for one kind of record; False if the writer had no room in time (some are left)."""
        while skipped and not self.store.writing_stopped:
            key, (parent, token_ids) = next(iter(skipped.items()))
            where = find(key)
            if where is not None:
                if not self.store.wait_for_room(num_bytes, max(0.0, deadline - time.monotonic())):
                    return False
                tensors = export(where)
                # still that key's block (or slot) after the copy: at exit an engine thread that has not stopped
                # may be reusing them, and one it took while we copied must not be written under this key
                if find(key) == where:
                    if not self.store.submit(BlockRecord(key, parent, token_ids, tensors, kind)):
                        return False
                    self.store.counters.num_writes_retried += 1
            del skipped[key]
        return True

    def flush(self, timeout_s: float) -> bool:
        """Write what the pool holds that the disk lacks: the queue, and the skipped blocks still in the pool
        (what a clean exit does, within `timeout_s`). False if time ran out first."""
        deadline = time.monotonic() + timeout_s
        self.save_skipped(timeout_s)
        return self.store.flush(max(0.0, deadline - time.monotonic())) and not self._skipped \
            and not self._skipped_states

    def worth_reading(self, num_records: int, num_tokens: int, num_states: int = 0) -> bool:
        """Whether reading `num_records` blocks and `num_states` state checkpoints is faster than prefilling the
        `num_tokens` they save (cost.py)."""
        return self.cost.worth_reading(num_records * self.record_bytes + num_states * self.state_bytes, num_tokens)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled `num_tokens` took `seconds` (the engine reports it: the rate loading competes with)."""
        self.cost.note_prefill(num_tokens, seconds)

    def start_reading(self, loads: Sequence[BlockLoad], states: Sequence[StateLoad] = ()) -> PrefixRead:
        """Read and check the records of `loads` on the reader threads, then the deepest of `states` usable with
        the blocks read; PrefixRead.finish puts the blocks in the pool, put_state the state in a slot."""
        started = time.perf_counter()  # before the first read starts: a read may end before PrefixRead exists
        chains = [self.store.chain_read([(load.key, load.parent, load.token_ids) for load in loads], self.specs)]
        return PrefixRead(self, list(loads), chains, self._readers.submit(self._read, chains, states), started)

    def _read(self, chains: list[ChainRead], states: Sequence[StateLoad]) -> _ReadResult:
        """The records of the prefix's chain up to the first miss (the blocks after it would not be used), then the
        first state checkpoint of `states` usable with them (its read appended to `chains`). An error nothing below
        foresaw is a miss of the whole prefix, counted and logged once: it must not reach the step."""
        try:
            found, num_queued = chains[0].run()
            state = self._read_state(chains, states, len(found))
        except Exception as exc:
            self.store.reject(chains[-1].reading or str(self.store.directory),
                              RecordRejected("unexpected", f"{type(exc).__name__}: {exc}"))
            return _ReadResult([], time.perf_counter(), 0, 0)
        num_bytes = sum(sum(chain.sizes[: len(chain.found)]) for chain in chains)
        return _ReadResult(found, time.perf_counter(), num_queued, num_bytes, *state)

    def _read_state(self, chains: list[ChainRead], states: Sequence[StateLoad],
                    num_found: int) -> tuple[StateLoad, list[torch.Tensor]] | tuple[()]:
        """The deepest of `states` usable with the `num_found` blocks read whose record reads and checks, with its
        tensors; none if one the manager holds comes first (or none is usable)."""
        for state in states:
            if state.num_loads > num_found:
                continue
            if state.held:
                return ()
            chains.append(self.store.chain_read([(state.key, state.parent, state.token_ids)], self.state_specs,
                                                STATE))
            found, _ = chains[-1].run()
            if found:
                return state, found[0]
        return ()

    def stats(self) -> dict[str, float | int]:
        return {**self.store.stats(), "disk_cache_hit_tokens": self.num_hit_tokens,
                "disk_cache_recomputed_tokens": self.cost.num_recomputed_tokens}


@dataclass(frozen=True)
class _ReadResult:
    """What a prefix read found: the blocks' tensors up to the first miss, when the reads ended, how many blocks
    came from the writer's queue, the bytes read from disk (the measured read rate's), and the state checkpoint
    read with its tensors, if any."""

    found: list[list[torch.Tensor]]
    ended_s: float
    num_queued: int
    num_bytes: int
    state: StateLoad | None = None
    state_tensors: list[torch.Tensor] | None = None


class PrefixRead:
    """A prefix's records being read on the reader threads, while the engine's steps go on (base.py:TierRead). Done
    when the read is, or READ_TIMEOUT_S after it started: then `finish` abandons it as a miss."""

    def __init__(self, tier: DiskKVCache, loads: list[BlockLoad], chains: list[ChainRead], job: ReadJob,
                 started_s: float):
        self.tier = tier
        self.loads = loads
        self.state: StateLoad | None = None  # after finish: the state checkpoint read, for put_state
        self._state_tensors: list[torch.Tensor] | None = None
        self._chains = chains  # the blocks' read, then any state checkpoint's (the reader thread appends)
        self._job = job
        self._started = started_s  # perf_counter() when the read was submitted
        self._deadline = started_s + READ_TIMEOUT_S

    def done(self) -> bool:
        return self._job.future.done() or time.perf_counter() >= self._deadline

    def wait(self, timeout_s: float) -> None:
        futures.wait([self._job.future], max(0.0, min(timeout_s, self._deadline - time.perf_counter())))

    def finish(self) -> int:
        """Put the records read into their pool blocks, in order up to the first miss (once done); returns how many.
        A read still running is abandoned: none (its reader thread's results are never used)."""
        if not self._job.future.done():
            self._abandon()
            return 0
        result: _ReadResult = self._job.future.result()
        for load, tensors in zip(self.loads, result.found):
            self.tier.cache.import_block(load.block_id, tensors)
        self.state, self._state_tensors = result.state, result.state_tensors
        read_s = result.ended_s - self._started
        self.tier.store.counters.read_s += read_s
        if result.num_bytes:  # the rate of reading from disk: a record taken from the queue cost no read
            self.tier.cost.note_read(result.num_bytes, read_s)
        return len(result.found)

    def put_state(self, slot: int) -> None:
        """Put the state checkpoint read into state slot `slot` (once finished, if `state` is not None)."""
        self.tier.state_cache.import_slot(slot, self._state_tensors)

    def _abandon(self) -> None:
        """Stop waiting: the next read may start, and the record it was stuck on is skipped from now on."""
        self._job.abandon()
        # the record it was on (None: it never started, the readers were stuck)
        path = self._chains[-1].reading or str(self.tier.store.directory)
        self.tier.store.reject(path, RecordRejected("timeout", f"not read within {READ_TIMEOUT_S:g} s"))


def _flush_tier_at_exit(tier: weakref.ref[DiskKVCache]) -> None:
    """A clean exit (SIGTERM to the server included) first writes what the pool holds that the disk lacks: the
    queued blocks and the skipped ones still in the pool (this runs before the store's own handler)."""
    if (alive := tier()) is not None:
        alive.flush(EXIT_FLUSH_S)
