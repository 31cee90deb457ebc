"""The disk tier's file store: records of one model fingerprint as files under a directory, least recently used
removed first to hold a cap shared by every model and process in the directory.

Writes run on a writer thread (writer.py). A record is written to a temporary file and renamed into place, so a
process killed mid-write leaves no partial record visible. Several processes may share a directory without a lock:
a record is complete once visible, two writers of one key write the same bytes, and a record removed under a reader
is a plain miss. A block still queued for the writer is found by lookups and read from memory. Only regular files no
larger than a record can be are read; a rejected one is removed, or, where it cannot be, skipped from then on."""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.tiers.chain_read import ChainLink, ChainRead, Specs
from kvserve.kv.tiers.directory import TEMP_PREFIX, open_directory, remove_dead_writers_temps
from kvserve.kv.tiers.files import checked_size, read_fd, write_new_file
from kvserve.kv.tiers.index import RecordIndex
from kvserve.kv.tiers.record import (BLOCK, ERROR_KINDS, BlockRecord, Checksum, RecordKind, RecordRejected,
                                     encode_record, max_record_bytes, parse_record)
from kvserve.kv.tiers.rejections import LEFT_IN_PLACE, Rejections
from kvserve.kv.tiers.writer import RecordWriter
from kvserve.planner.units import format_bytes

logger = logging.getLogger("kvserve")

EXIT_FLUSH_S = 10.0  # at interpreter exit, wait this long for queued (and skipped) blocks to be written
EXIT_JOIN_S = 2.0  # ... then this long for the writer thread to end (it finishes the record it is writing)


@dataclass
class DiskCacheCounters:
    num_reads: int = 0  # blocks read and verified
    num_queued_reads: int = 0  # blocks found still queued for the writer, taken from memory
    bytes_read: int = 0
    read_s: float = 0.0  # wall time of admission's reads (files read, checked, decoded, put in the pool)
    num_writes: int = 0
    bytes_written: int = 0
    num_writes_skipped: int = 0  # the writer was behind by MAX_PENDING_BYTES (handed again later), or over the cap
    num_writes_retried: int = 0  # skipped blocks handed again once the writer had room (still in the pool)
    num_evicted: int = 0  # records removed to hold the cap
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))


class DiskBlockStore:
    """Records of one model fingerprint in `directory`/<fingerprint[:16]>/, at most `capacity_bytes` of records in
    all of `directory` (least recently used removed first); a thread writes what `submit` hands it."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fingerprint: dict[str, str]):
        self.root = Path(directory).expanduser()
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint["digest"]
        self.directory = self.root / self.fingerprint[:16]
        self._directory = str(self.directory)  # records' paths are plain strings: pathlib costs more than a read
        self._salt = bytes.fromhex(self.fingerprint)
        open_directory(self.root, self.directory, fingerprint)
        self.counters = DiskCacheCounters()
        self.rejections = Rejections(self.counters.errors)
        self.writing_stopped = False
        self._cond = threading.Condition()  # guards the index and the read counters (reads run on several threads)
        self.index = RecordIndex(self.root, self._directory)
        # the class's _write, looked up at each call (tests hold a write back by patching it)
        self.writer = RecordWriter(lambda record: self._write(record), self._count_skipped)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvserve-disk-checker")  # read_chain's checksums
        remove_dead_writers_temps(self.root)
        with self._cond:
            self.index.scan()
        self.num_records_at_start = self.index.num_own_records
        self.num_states_at_start = self.index.num_own_states
        atexit.register(_flush_at_exit, weakref.ref(self))

    def start_line(self, block_size: int, num_groups: int) -> str:
        """e.g. "KV disk cache: /data/kv, 20.00 GiB cap, 12,345 blocks (197,520 tokens) from earlier runs"."""
        tokens = self.num_records_at_start // num_groups * block_size
        blocks = f"{self.num_records_at_start:,} block{'' if self.num_records_at_start == 1 else 's'}"
        n = self.num_states_at_start
        states = f" and {n:,} state checkpoint{'' if n == 1 else 's'}" if n else ""
        line = (f"KV disk cache: {self.root}, {format_bytes(self.capacity_bytes)} cap, {blocks} ({tokens:,} tokens)"
                f"{states} from earlier runs")
        others = len(self.index.files) - self.index.num_own_records - self.index.num_own_states
        if others:
            line += f"; {others:,} records of other models or formats share the cap"
        return line

    # ---- reads: lookups on the step thread, records read on the reader threads ---------------------------
    def contains(self, key: BlockHash, kind: RecordKind = BLOCK) -> bool:
        """Whether a record of `kind` for `key` is on disk now (any process's; it is verified only when read; one
        skipped as unremovable or too slow is not) or queued for the writer here (read from memory)."""
        if (kind.name, key) in self.writer.pending:
            return True
        path = self.record_file(key, kind)
        return not self.rejections.skips(path) and os.path.exists(path)

    def read(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
             specs: Specs) -> list[torch.Tensor] | None:
        """The block's tensors, verified; None on a miss. A bad record is counted, logged once and removed."""
        found = self.read_chain([(key, parent, token_ids)], specs)
        return found[0] if found else None

    def read_chain(self, records: Sequence[ChainLink], specs: Specs) -> list[list[torch.Tensor]]:
        """The tensors of `records` ((key, parent, token ids) of a prefix's blocks, in order), verified, up to the
        first miss (read_chain_counted)."""
        return self.read_chain_counted(records, specs)[0]

    def read_chain_counted(self, records: Sequence[ChainLink], specs: Specs) -> tuple[list[list[torch.Tensor]], int]:
        """The tensors of `records` ((key, parent, token ids) of a prefix's blocks, in order), verified, up to the
        first miss, and how many of them came from the writer's queue rather than from disk (chain_read.py)."""
        return self.chain_read(records, specs).run()

    def chain_read(self, records: Sequence[ChainLink], specs: Specs, kind: RecordKind = BLOCK) -> ChainRead:
        """A read of `records` of `kind` to `run` (on a reader thread); it says which record it is reading
        (`reading`)."""
        return ChainRead(self, self._checker, records, specs, kind)

    def count_reads(self, num_reads: int, num_queued_reads: int, num_bytes: int) -> None:
        with self._cond:  # reads run on several threads
            self.counters.num_reads += num_reads
            self.counters.num_queued_reads += num_queued_reads
            self.counters.bytes_read += num_bytes

    def queued(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
               kind: RecordKind = BLOCK) -> BlockRecord | None:
        """The record of `kind` queued (or being written) for `key`, if it is the one the request's chain asks for."""
        return self.writer.queued(key, parent, token_ids, kind)

    def read_record(self, fd: int, path: str, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
                    specs: Specs, kind: RecordKind = BLOCK
                    ) -> tuple[tuple[list[torch.Tensor], Checksum, int] | None, bool]:
        """The record's tensors, its checksum to check and its size in bytes (None: rejected), and whether it was
        all in the page cache. Only a regular file no larger than a record of `specs` can be is read."""
        try:
            data, cached = read_fd(fd, checked_size(fd, max_record_bytes(specs, len(token_ids))))
        except RecordRejected as rejected:
            self.reject(path, rejected)
            return None, True
        except OSError as exc:
            self.reject(path, RecordRejected("read", f"{type(exc).__name__}: {exc}"))
            return None, True
        try:
            tensors, checksum = parse_record(data, self.fingerprint, key, parent, token_ids, specs, kind)
        except RecordRejected as rejected:
            self.reject(path, rejected)
            return None, cached
        try:  # used: first to stay, here and (through its mtime) for other processes and restarts
            os.utime(fd)
        except OSError:
            pass
        with self._cond:
            self.index.touch(path)
        return (tensors, checksum, len(data)), cached

    def path(self, key: BlockHash, kind: RecordKind = BLOCK) -> Path:
        """Where `key`'s record of `kind` is (or would be)."""
        return Path(self.record_file(key, kind))

    def record_file(self, key: BlockHash, kind: RecordKind = BLOCK) -> str:
        """A block's record and the state checkpoint after it share a name, not a suffix."""
        return os.path.join(self._directory, hashlib.sha256(self._salt + key).hexdigest() + kind.suffix)

    def skips(self, path: str) -> bool:
        return self.rejections.skips(path)

    def reject(self, path: str, rejected: RecordRejected) -> None:
        """A record not used: counted by kind, logged once per kind, removed or skipped (rejections.py)."""
        if rejected.kind not in LEFT_IN_PLACE:  # gone, or never evictable: out of the cap's count
            with self._cond:
                self.index.forget(path)
        self.rejections.reject(path, rejected)

    # ---- writes: submit on the step thread, written on the writer thread (writer.py) -----------------------
    def submit(self, record: BlockRecord) -> bool:
        """Queue a block for writing; never waits. False if it was skipped because the writer is MAX_PENDING_BYTES
        behind (the caller may hand it again later); True if queued, queued already, or writing has stopped."""
        return self.writing_stopped or self.writer.submit(record)

    def wait_for_room(self, num_bytes: int, timeout_s: float) -> bool:
        return self.writer.wait_for_room(num_bytes, timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.writer.flush(timeout_s)

    def stop_writer(self, timeout_s: float) -> None:
        self.writer.stop(timeout_s)

    def _write(self, record: BlockRecord) -> None:
        path = self.record_file(record.key, record.kind)
        if self.writing_stopped or os.path.exists(path):  # another process (or an earlier run) wrote it
            return
        data = encode_record(self.fingerprint, record)
        if len(data) > self.capacity_bytes:
            self.counters.num_writes_skipped += 1
            return
        temp = self.directory / f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}"
        try:
            with self._cond:
                self.counters.num_evicted += self.index.make_room(len(data), self.capacity_bytes)
            write_new_file(temp, data)
            os.replace(temp, path)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            self._stop_writing(exc)
            return
        with self._cond:
            self.index.remember(path, len(data))
        self.counters.num_writes += 1
        self.counters.bytes_written += len(data)

    def _count_skipped(self) -> None:
        self.counters.num_writes_skipped += 1

    def _stop_writing(self, exc: OSError) -> None:
        self.writing_stopped = True
        self.counters.errors["write"] += 1
        logger.warning(f"KV disk cache: writing to {self.directory} stopped ({type(exc).__name__}: {exc}); serving "
                       "goes on, and the records already there are still read")

    def stats(self) -> dict[str, float | int]:
        c = self.counters
        with self._cond:
            self.index.forget_if_gone()  # a directory removed under us holds no records: no stale gauges
            blocks, states, nbytes = self.index.num_own_records, self.index.num_own_states, self.index.nbytes
        return {"disk_cache_blocks": blocks, "disk_cache_state_checkpoints": states, "disk_cache_bytes": nbytes,
                "disk_cache_capacity_bytes": self.capacity_bytes,
                "disk_cache_reads": c.num_reads, "disk_cache_queued_reads": c.num_queued_reads,
                "disk_cache_bytes_read": c.bytes_read,
                "disk_cache_read_seconds": c.read_s, "disk_cache_writes": c.num_writes,
                "disk_cache_bytes_written": c.bytes_written, "disk_cache_writes_skipped": c.num_writes_skipped,
                "disk_cache_writes_retried": c.num_writes_retried,
                "disk_cache_evicted": c.num_evicted, "disk_cache_writing_stopped": int(self.writing_stopped),
                **{f"disk_cache_errors_{kind}": n for kind, n in c.errors.items()}}


def _flush_at_exit(store: weakref.ref[DiskBlockStore]) -> None:
    """A clean exit first writes what is queued (daemon threads still run while atexit handlers do), then ends the
    writer thread."""
    if (alive := store()) is not None:
        alive.flush(EXIT_FLUSH_S)
        alive.stop_writer(EXIT_JOIN_S)
