"""The disk tier's file store: records of one model fingerprint as files under a directory, least recently used
removed first to hold a cap shared by every model and process in the directory.

Writes run on a writer thread; the step thread only queues a block's bytes (a block the writer has no room for is
refused, for the caller to hand again later). A record is written to a temporary file and renamed into place, so a
process killed mid-write leaves no partial record visible. Several processes may share a directory without a lock:
a record is complete once visible, two writers of one key write the same bytes, and a record removed under a reader
is a plain miss. A block still queued for the writer is found by lookups and read from memory."""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.tiers.chain_read import ChainLink, ChainRead, Specs
from kvserve.kv.tiers.files import process_alive, read_fd, remove, write_new_file
from kvserve.kv.tiers.record import ERROR_KINDS, BlockRecord, Checksum, RecordRejected, encode_record, parse_record
from kvserve.planner.units import format_bytes

logger = logging.getLogger("kvserve")

RECORD_SUFFIX = ".kvblock"
TEMP_PREFIX = ".tmp-"
MAX_PENDING_BYTES = 256 * 2**20  # blocks copied for the writer and not yet written; more are skipped, not waited for
WRITER_IDLE_S = 1.0  # the writer thread ends after this long without work (a later block starts a new one)
RESCAN_S = 10.0  # when evicting, see other processes' records at most this often
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
        self._make_directory(fingerprint)
        self.counters = DiskCacheCounters()
        self.writing_stopped = False
        self._cond = threading.Condition()  # guards everything below
        self._files: OrderedDict[str, int] = OrderedDict()  # every record's path under root, least recently used first
        self.nbytes = 0
        self.num_own_records = 0  # of those, this fingerprint's
        self._scanned_at = 0.0
        self._queue: deque[BlockRecord] = deque()
        # queued or being written: a lookup finds these too, and a read takes their tensors from here (the writer
        # may be behind the step thread by seconds when both want the GIL; a returning request must not miss them)
        self._pending: dict[BlockHash, BlockRecord] = {}
        self._pending_bytes = 0
        self._writer: threading.Thread | None = None
        self._closing = False  # the interpreter is exiting: the writer ends after its record (stop_writer)
        self._logged: set[str] = set()
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvserve-disk-checker")  # read_chain's checksums
        self._remove_dead_writers_temps()
        with self._cond:
            self._scan()
        self.num_records_at_start = self.num_own_records
        atexit.register(_flush_at_exit, weakref.ref(self))

    def start_line(self, block_size: int, num_groups: int) -> str:
        """e.g. "KV disk cache: /data/kv, 20.00 GiB cap, 12,345 blocks (197,520 tokens) from earlier runs"."""
        tokens = self.num_records_at_start // num_groups * block_size
        blocks = f"{self.num_records_at_start:,} block{'' if self.num_records_at_start == 1 else 's'}"
        line = (f"KV disk cache: {self.root}, {format_bytes(self.capacity_bytes)} cap, {blocks} ({tokens:,} tokens) "
                "from earlier runs")
        others = len(self._files) - self.num_own_records
        if others:
            line += f"; {others:,} records of other models or formats share the cap"
        return line

    # ---- reads: lookups on the step thread, records read on the reader threads ---------------------------
    def contains(self, key: BlockHash) -> bool:
        """Whether a record for `key` is on disk now (any process's; it is verified only when read) or queued for
        the writer here (read from memory)."""
        return key in self._pending or os.path.exists(self.record_file(key))

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
        return ChainRead(self, self._checker, records, specs).run()

    def count_reads(self, num_reads: int, num_queued_reads: int, num_bytes: int) -> None:
        with self._cond:  # reads run on several threads
            self.counters.num_reads += num_reads
            self.counters.num_queued_reads += num_queued_reads
            self.counters.bytes_read += num_bytes

    def queued(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> BlockRecord | None:
        """The record queued (or being written) for `key`, if it is the one the request's chain asks for."""
        with self._cond:
            record = self._pending.get(key)
        if record is None or record.parent != parent or record.token_ids != tuple(token_ids):
            return None
        return record

    def read_record(self, fd: int, path: str, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
                    specs: Specs) -> tuple[tuple[list[torch.Tensor], Checksum, int] | None, bool]:
        """The record's tensors, its checksum to check and its size in bytes (None: rejected), and whether it was
        all in the page cache."""
        try:
            data, cached = read_fd(fd)
        except OSError as exc:
            self.reject(path, RecordRejected("read", f"{type(exc).__name__}: {exc}"))
            return None, True
        try:
            tensors, checksum = parse_record(data, self.fingerprint, key, parent, token_ids, specs)
        except RecordRejected as rejected:
            self.reject(path, rejected)
            return None, cached
        try:  # used: first to stay, here and (through its mtime) for other processes and restarts
            os.utime(fd)
        except OSError:
            pass
        with self._cond:
            if path in self._files:
                self._files.move_to_end(path)
        return (tensors, checksum, len(data)), cached

    def path(self, key: BlockHash) -> Path:
        """Where `key`'s record is (or would be)."""
        return Path(self.record_file(key))

    def record_file(self, key: BlockHash) -> str:
        return os.path.join(self._directory, hashlib.sha256(self._salt + key).hexdigest() + RECORD_SUFFIX)

    def reject(self, path: str, rejected: RecordRejected) -> None:
        with self._cond:
            self.counters.errors[rejected.kind] += 1
            first = rejected.kind not in self._logged
            self._logged.add(rejected.kind)
            self._forget(path)
        if first:
            logger.warning(f"KV disk cache: {os.path.basename(path)} rejected ({rejected.kind}: {rejected}); read as "
                           f"a miss and removed (later {rejected.kind} records are only counted: "
                           "kvserve:kv_disk_cache_errors)")
        remove(path)

    # ---- writes: submit on the step thread, written on the writer thread ---------------------------------------
    def submit(self, record: BlockRecord) -> bool:
        """Queue a block for writing; never waits. False if it was skipped because the writer is MAX_PENDING_BYTES
        behind (the caller may hand it again later); True if queued, queued already, or writing has stopped."""
        with self._cond:
            if self.writing_stopped or self._closing or record.key in self._pending:
                return True
            if self._pending_bytes + record.nbytes > MAX_PENDING_BYTES:
                self.counters.num_writes_skipped += 1
                return False
            self._queue.append(record)
            self._pending[record.key] = record
            self._pending_bytes += record.nbytes
            if self._writer is None:
                writer = threading.Thread(target=self._write_queued, name="kvserve-disk-writer", daemon=True)
                try:
                    writer.start()
                    self._writer = writer
                except RuntimeError:  # an exiting interpreter starts no threads (3.12+): flush writes on its own
                    pass
            self._cond.notify_all()
            return True

    def wait_for_room(self, num_bytes: int, timeout_s: float) -> bool:
        """Wait until the writer is less than half of MAX_PENDING_BYTES behind with `num_bytes` more; False if
        `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_bytes + num_bytes <= MAX_PENDING_BYTES // 2, timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is written (or skipped); False if `timeout_s` passed first. With no writer
        thread (none could start: the interpreter is exiting) the queue is written here."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._writer is None and (deadline is None or time.monotonic() < deadline) and self._write_next():
            pass
        with self._cond:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._cond.wait_for(lambda: not self._pending, left)

    def stop_writer(self, timeout_s: float) -> None:
        """End the writer thread (after the record it is writing) and wait up to `timeout_s` for it: what is still
        queued stays unwritten. At exit, after the flush, so that no daemon thread is still running library code while
        the interpreter finalizes, which can abort the process (CI's disk-tier exit test aborted once with
        "terminate called without an active exception"; not reproduced since)."""
        with self._cond:
            self._closing = True
            writer = self._writer
            self._cond.notify_all()
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout_s)

    def _write_queued(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(WRITER_IDLE_S)
                if not self._queue or self._closing:
                    self._writer = None
                    self._cond.notify_all()
                    return
            self._write_next()

    def _write_next(self) -> bool:
        """Write the oldest queued block; False if none was queued."""
        with self._cond:
            if not self._queue:
                return False
            record = self._queue.popleft()
        try:
            self._write(record)
        finally:
            with self._cond:
                del self._pending[record.key]
                self._pending_bytes -= record.nbytes
                self._cond.notify_all()
        return True

    def _write(self, record: BlockRecord) -> None:
        path = self.record_file(record.key)
        if self.writing_stopped or os.path.exists(path):  # another process (or an earlier run) wrote it
            return
        data = encode_record(self.fingerprint, record)
        if len(data) > self.capacity_bytes:
            self.counters.num_writes_skipped += 1
            return
        temp = self.directory / f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}"
        try:
            self._make_room(len(data))
            write_new_file(temp, data)
            os.replace(temp, path)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            self._stop_writing(exc)
            return
        with self._cond:
            self._remember(path, len(data))
        self.counters.num_writes += 1
        self.counters.bytes_written += len(data)

    def _stop_writing(self, exc: OSError) -> None:
        self.writing_stopped = True
        self.counters.errors["write"] += 1
        logger.warning(f"KV disk cache: writing to {self.directory} stopped ({type(exc).__name__}: {exc}); serving "
                       "goes on, and the records already there are still read")

    # ---- the cap ------------------------------------------------------------------------------------------
    def _make_room(self, num_bytes: int) -> None:
        """Remove least recently used records until `num_bytes` more fit under the cap."""
        with self._cond:
            if self.nbytes + num_bytes > self.capacity_bytes and time.monotonic() - self._scanned_at > RESCAN_S:
                self._scan()  # count what other processes wrote since
            while self._files and self.nbytes + num_bytes > self.capacity_bytes:
                oldest = next(iter(self._files))
                self._forget(oldest)
                remove(oldest)
                self.counters.num_evicted += 1

    def _scan(self) -> None:
        """Every record under root, ordered by last use (mtime); callers hold the lock."""
        found = []
        for directory in (d for d in self.root.iterdir() if d.is_dir()):
            for entry in os.scandir(directory):
                if entry.name.endswith(RECORD_SUFFIX):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    found.append((stat.st_mtime_ns, entry.path, stat.st_size))
        self._files.clear()
        self.nbytes = self.num_own_records = 0
        for _, path, size in sorted(found, key=lambda f: f[0]):
            self._remember(path, size)
        self._scanned_at = time.monotonic()

    def _remember(self, path: str, size: int) -> None:
        if path not in self._files:
            self._files[path] = size
            self.nbytes += size
            self.num_own_records += os.path.dirname(path) == self._directory

    def _forget(self, path: str) -> None:
        size = self._files.pop(path, None)
        if size is not None:
            self.nbytes -= size
            self.num_own_records -= os.path.dirname(path) == self._directory

    # ---- start-up -----------------------------------------------------------------------------------------
    def _make_directory(self, fingerprint: dict[str, str]) -> None:
        """Create the directories (owner only) and prove they take a file: an unwritable one fails here, clearly."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # (mkdir gives parents the default mode)
            self.directory.mkdir(mode=0o700, exist_ok=True)
            description = self.directory / "model.json"
            temp = self.directory / f"{TEMP_PREFIX}{os.getpid()}-start"
            write_new_file(temp, json.dumps(fingerprint, indent=1, sort_keys=True).encode())
            os.replace(temp, description)
        except OSError as exc:
            raise ValueError(f"--kv-disk-cache {self.root}: cannot write there ({type(exc).__name__}: "
                             f"{exc.strerror or exc})") from exc

    def _remove_dead_writers_temps(self) -> None:
        """Temporary files of processes that died mid-write (named .tmp-PID-...); live writers' are left alone."""
        for directory in (d for d in self.root.iterdir() if d.is_dir()):
            for temp in directory.glob(f"{TEMP_PREFIX}*"):
                pid = temp.name.removeprefix(TEMP_PREFIX).split("-")[0]
                if pid.isdigit() and not process_alive(int(pid)):
                    temp.unlink(missing_ok=True)

    def stats(self) -> dict[str, float | int]:
        c = self.counters
        with self._cond:
            blocks, nbytes = self.num_own_records, self.nbytes
        return {"disk_cache_blocks": blocks, "disk_cache_bytes": nbytes,
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
