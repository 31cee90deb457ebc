"""The disk tier below the pool: full prefix blocks kept as files, so a prefix outlives the pool's LRU and the process.

What is stored: each block the prefix index registers (never one an eviction policy changed: those are never
registered), exactly as the pool holds it (`PagedKVCache.export_block`: every tensor of its format, every layer of
its group), one safetensors file per block and layer group, named sha256(model fingerprint, block key). The key
chains through the whole prefix, with the storage format and cache_salt in its root (kv/block_hash.py), and the
fingerprint names what the bytes mean (weights, tokenizer, config, layer layout, block size, KV format), so a
record is found only by the same model, format and tenant. Each record also carries its parent key, its token ids
and a CRC-32 of its tensors; a read checks all of them against what the request expects, so a damaged, truncated,
foreign or mismatched file is a miss (counted by kind, logged once, removed), never a wrong answer.

Writes run on a writer thread; the step thread only copies a new block's bytes out of the pool (a block the writer
has no room for is handed again later, from the pool, and at a clean exit). A record is written to a temporary file
and renamed into place, so a process killed mid-write leaves no partial record visible. Several processes may share
a directory without a lock: a record is complete once visible, two writers of one key write the same bytes, and a
record removed under a reader is a plain miss. Reads start on admission and run on reader threads while the steps go
on (checksums on a checker thread); the request waits, and its blocks join the pool's prefix index once read."""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.kv_cache_manager import BlockLoad
from kvserve.planner.units import format_bytes

logger = logging.getLogger("kvserve")

RECORD_FORMAT = "kvserve-kv-block"
RECORD_VERSION = "2"  # bump when what a record's tensors mean changes: old records then belong to no fingerprint
RECORD_SUFFIX = ".kvblock"
TEMP_PREFIX = ".tmp-"
# Files whose bytes decide a block's K/V (besides the weights): the config (layers, heads, RoPE, windows) and the
# tokenizer (which ids the keys chain over).
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
MAX_PENDING_BYTES = 256 * 2**20  # blocks copied for the writer and not yet written; more are skipped, not waited for
WRITER_IDLE_S = 1.0  # the writer thread ends after this long without work (a later block starts a new one)
RESCAN_S = 10.0  # when evicting, see other processes' records at most this often
READ_THREADS = 2  # prefixes read at once; each prefix's records are read in order on one thread (see DiskKVCache)
READ_AHEAD = 32  # records of a prefix opened (and, once one comes from the disk, hinted) ahead of the one being read
CHECK_BATCH = 8  # records whose checksums the checker thread takes at once (a task per record costs more than it saves)
EXIT_FLUSH_S = 10.0  # at interpreter exit, wait this long for queued (and skipped) blocks to be written
EXIT_JOIN_S = 2.0  # ... then this long for the writer thread to end (it finishes the record it is writing)
MAX_SKIPPED = 1 << 16  # skipped blocks remembered to hand again (a key, parent and 16 token ids each)
ERROR_KINDS = ("corrupt", "mismatch", "foreign", "read", "write")


def model_fingerprint(model_path: Path, **facts: object) -> dict[str, str]:
    """What stored bytes mean: sha256 of the model's weights, config and tokenizer files, plus `facts` (KV format,
    block size, dtype, layout...). "digest" hashes all of it; it is the store's key namespace."""
    parts = {path.name: _file_sha256(path) for path in sorted(Path(model_path).iterdir())
             if path.suffix == ".safetensors" or path.name in MODEL_FILES}
    parts.update({name: str(value) for name, value in facts.items()})
    parts["record_version"] = RECORD_VERSION
    return {**parts, "digest": hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()}


_file_digests: dict[tuple[str, int, int], str] = {}  # a weights file is hashed once per process


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _file_digests:
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            while chunk := file.read(1 << 24):
                digest.update(chunk)
        _file_digests[memo] = digest.hexdigest()
    return _file_digests[memo]


@dataclass(frozen=True)
class BlockRecord:
    """One block's contents on their way to disk, with what a reader checks them against."""

    key: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def tensors_crc32(tensors: Sequence[torch.Tensor | memoryview]) -> str:
    """The CRC-32 of the tensors' bytes, in order: a record's checksum. It guards against damage (a torn, truncated
    or bit-flipped file); what the record claims to be is checked against the request's own key chain and tokens.
    zlib's CRC is faster than sha256 over the same bytes, and releases the GIL while it runs."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor if isinstance(tensor, memoryview) else _bytes_of(tensor), crc)
    return f"{crc:08x}"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def encode_record(fingerprint: str, record: BlockRecord) -> bytes:
    """A safetensors file: the block's tensors t0..tn, and metadata naming the model, the key chain and tokens."""
    metadata = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "fingerprint": fingerprint,
                "key": record.key.hex(), "parent": record.parent.hex() if record.parent else "",
                "token_ids": json.dumps(list(record.token_ids)), "crc32": tensors_crc32(record.tensors)}
    return safetensors.torch.save({f"t{i}": t.contiguous() for i, t in enumerate(record.tensors)}, metadata)


def _header(data: bytes | bytearray) -> dict:
    """A safetensors file's header (8-byte little-endian length, then JSON): tensor entries and __metadata__."""
    (length,) = struct.unpack("<Q", data[:8])
    if not 2 <= length <= len(data) - 8:
        raise ValueError(f"header length {length} outside the file's {len(data)} bytes")
    return json.loads(data[8 : 8 + length])


def record_metadata(data: bytes | bytearray) -> dict[str, str]:
    """The metadata of a safetensors file's bytes."""
    return _header(data)["__metadata__"]


class RecordRejected(Exception):
    """A record that must not be used: `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
                       torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
                       torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def decode_record(data: bytearray, fingerprint: str, key: BlockHash, parent: BlockHash | None,
                  token_ids: Sequence[int], specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The tensors of a record if it is exactly the block asked for; raises RecordRejected otherwise. The tensors are
    views of `data` (no copy): each entry of the safetensors header must be the dtype and shape the pool expects,
    and lie within the file, and their bytes must match the record's checksum."""
    tensors, checksum = parse_record(data, fingerprint, key, parent, token_ids, specs)
    if not checksum.matches():
        raise RecordRejected("corrupt", "checksum mismatch")
    return tensors


class _Queued:
    """The checksum of a record read from the writer's queue: this process's own bytes, nothing to check."""

    @staticmethod
    def matches() -> bool:
        return True


_QUEUED = _Queued()


@dataclass(frozen=True)
class Checksum:
    """A record's tensors' bytes and the CRC-32 its metadata gives for them (checked apart from the parse: the
    disk tier checks a prefix's records on another thread while it reads the next ones)."""

    views: list[memoryview]
    expected: str | None

    def matches(self) -> bool:
        return tensors_crc32(self.views) == self.expected


def parse_record(data: bytearray, fingerprint: str, key: BlockHash, parent: BlockHash | None,
                 token_ids: Sequence[int], specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]
                 ) -> tuple[list[torch.Tensor], Checksum]:
    """decode_record but for the checksum, which it returns to be checked."""
    try:
        header = _header(data)
        metadata = header.pop("__metadata__")
    except Exception as exc:
        raise RecordRejected("foreign", f"not a safetensors file ({type(exc).__name__})") from exc
    if not isinstance(metadata, dict) or metadata.get("format") != RECORD_FORMAT:
        raise RecordRejected("foreign", "not a kvserve KV block record")
    if metadata.get("version") != RECORD_VERSION or metadata.get("fingerprint") != fingerprint:
        raise RecordRejected("foreign", "written for another model, format or kvserve record version")
    expected = {"key": key.hex(), "parent": parent.hex() if parent else "", "token_ids": json.dumps(list(token_ids))}
    wrong = [name for name, value in expected.items() if metadata.get(name) != value]
    if wrong:
        raise RecordRejected("mismatch", f"its {', '.join(wrong)} differ from the request's")
    start = 8 + struct.unpack("<Q", data[:8])[0]
    if len(header) != len(specs):
        raise RecordRejected("mismatch", "its tensors' dtypes or shapes differ from the pool's")
    views, tensors = [], []
    for i, (dtype, shape) in enumerate(specs):
        entry = header.get(f"t{i}")
        if not isinstance(entry, dict) or entry.get("dtype") != _SAFETENSORS_DTYPES.get(dtype) \
                or tuple(entry.get("shape", ())) != shape:
            raise RecordRejected("mismatch", "its tensors' dtypes or shapes differ from the pool's")
        try:
            begin, end = (start + int(offset) for offset in entry["data_offsets"])
        except Exception as exc:
            raise RecordRejected("corrupt", f"unreadable tensor offsets ({type(exc).__name__})") from exc
        if not start <= begin <= end <= len(data) or end - begin != dtype.itemsize * math.prod(shape):
            raise RecordRejected("corrupt", "a tensor lies outside the file (truncated?)")
        views.append(memoryview(data)[begin:end])
        tensors.append(torch.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=begin).view(shape))
    return tensors, Checksum(views, metadata.get("crc32"))


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
        return key in self._pending or os.path.exists(self._file(key))

    def read(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
             specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor] | None:
        """The block's tensors, verified; None on a miss. A bad record is counted, logged once and removed."""
        found = self.read_chain([(key, parent, token_ids)], specs)
        return found[0] if found else None

    def read_chain(self, records: Sequence[tuple[BlockHash, BlockHash | None, Sequence[int]]],
                   specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[list[torch.Tensor]]:
        """The tensors of `records` ((key, parent, token ids) of a prefix's blocks, in order), verified, up to the
        first miss (read_chain_counted)."""
        return self.read_chain_counted(records, specs)[0]

    def read_chain_counted(self, records: Sequence[tuple[BlockHash, BlockHash | None, Sequence[int]]],
                           specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]
                           ) -> tuple[list[list[torch.Tensor]], int]:
        """The tensors of `records` ((key, parent, token ids) of a prefix's blocks, in order), verified, up to the
        first miss, and how many of them came from the writer's queue rather than from disk.

        The next READ_AHEAD records are kept open ahead of the one being read; once a record is found outside the
        page cache, the kernel is asked to read those ahead too (posix_fadvise WILLNEED), so the disk sees many at
        once rather than one file's latency at a time (while records come from the page cache the hint costs a
        walk over their cached pages and saves nothing). Checksums run on the store's checker thread, CHECK_BATCH
        records at a time, while this thread reads the next records: zlib releases the GIL while it runs."""
        paths = [self._file(key) for key, _, _ in records]
        ahead: deque[int | None] = deque()  # open files of the records after the one being read (None: missing)
        cold = False  # a record came from the disk: hint the kernel about every record ahead

        def open_ahead() -> None:
            while len(ahead) < READ_AHEAD and (n := len(found) + len(ahead)) < len(paths):
                ahead.append(_open_record(paths[n], cold))

        found: list[list[torch.Tensor]] = []
        checks: list[Future] = []  # each: how many of its batch of checksums match before the first that does not
        batch: list[Checksum] = []
        sizes: list[int] = []  # bytes read for each record found (0: taken from the writer's queue)
        queued_flags: list[bool] = []
        try:
            for (key, parent, token_ids), path in zip(records, paths):
                open_ahead()
                fd = ahead.popleft()
                queued = self._queued(key, parent, token_ids)
                if queued is not None:  # still on its way to disk: this process's own copy, nothing to check
                    if fd is not None:
                        os.close(fd)
                    found.append(queued.tensors)
                    batch.append(_QUEUED)
                    sizes.append(0)
                    queued_flags.append(True)
                    if len(batch) == CHECK_BATCH:
                        checks.append(self._checker.submit(_num_matching, batch))
                        batch = []
                    continue
                if fd is None:  # written since it was opened ahead (it was queued), or else evicted since the lookup
                    fd = _open_record(path, cold)
                if fd is None:  # evicted, by this process or another, since the lookup saw it
                    break
                try:
                    read, cached = self._read_record(fd, path, key, parent, token_ids, specs)
                finally:
                    os.close(fd)
                if not cached and not cold:
                    cold = True
                    for other in ahead:
                        _read_ahead(other)
                if read is None:
                    break
                found.append(read[0])
                batch.append(read[1])
                sizes.append(read[2])
                queued_flags.append(False)
                if len(batch) == CHECK_BATCH:
                    checks.append(self._checker.submit(_num_matching, batch))
                    batch = []
        finally:
            for fd in ahead:
                if fd is not None:
                    os.close(fd)
        if batch:
            checks.append(self._checker.submit(_num_matching, batch))
        for i, check in enumerate(checks):
            if (bad := i * CHECK_BATCH + check.result()) < min((i + 1) * CHECK_BATCH, len(found)):
                self._reject(paths[bad], RecordRejected("corrupt", "checksum mismatch"))
                del found[bad:]
                break
        num_queued = sum(queued_flags[: len(found)])
        with self._cond:  # reads run on several threads
            self.counters.num_reads += len(found) - num_queued
            self.counters.num_queued_reads += num_queued
            self.counters.bytes_read += sum(sizes[: len(found)])
        return found, num_queued

    def _queued(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> BlockRecord | None:
        """The record queued (or being written) for `key`, if it is the one the request's chain asks for."""
        with self._cond:
            record = self._pending.get(key)
        if record is None or record.parent != parent or record.token_ids != tuple(token_ids):
            return None
        return record

    def _read_record(self, fd: int, path: str, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
                     specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]
                     ) -> tuple[tuple[list[torch.Tensor], Checksum, int] | None, bool]:
        """The record's tensors, its checksum to check and its size in bytes (None: rejected), and whether it was
        all in the page cache."""
        try:
            data, cached = _read_fd(fd)
        except OSError as exc:
            self._reject(path, RecordRejected("read", f"{type(exc).__name__}: {exc}"))
            return None, True
        try:
            tensors, checksum = parse_record(data, self.fingerprint, key, parent, token_ids, specs)
        except RecordRejected as rejected:
            self._reject(path, rejected)
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
        return Path(self._file(key))

    def _file(self, key: BlockHash) -> str:
        return os.path.join(self._directory, hashlib.sha256(self._salt + key).hexdigest() + RECORD_SUFFIX)

    def _reject(self, path: str, rejected: RecordRejected) -> None:
        with self._cond:
            self.counters.errors[rejected.kind] += 1
            first = rejected.kind not in self._logged
            self._logged.add(rejected.kind)
            self._forget(path)
        if first:
            logger.warning(f"KV disk cache: {os.path.basename(path)} rejected ({rejected.kind}: {rejected}); read as "
                           f"a miss and removed (later {rejected.kind} records are only counted: "
                           "kvserve:kv_disk_cache_errors)")
        _remove(path)

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
        path = self._file(record.key)
        if self.writing_stopped or os.path.exists(path):  # another process (or an earlier run) wrote it
            return
        data = encode_record(self.fingerprint, record)
        if len(data) > self.capacity_bytes:
            self.counters.num_writes_skipped += 1
            return
        temp = self.directory / f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}"
        try:
            self._make_room(len(data))
            _write_new_file(temp, data)
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
                _remove(oldest)
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
            _write_new_file(temp, json.dumps(fingerprint, indent=1, sort_keys=True).encode())
            os.replace(temp, description)
        except OSError as exc:
            raise ValueError(f"--kv-disk-cache {self.root}: cannot write there ({type(exc).__name__}: "
                             f"{exc.strerror or exc})") from exc

    def _remove_dead_writers_temps(self) -> None:
        """Temporary files of processes that died mid-write (named .tmp-PID-...); live writers' are left alone."""
        for directory in (d for d in self.root.iterdir() if d.is_dir()):
            for temp in directory.glob(f"{TEMP_PREFIX}*"):
                pid = temp.name.removeprefix(TEMP_PREFIX).split("-")[0]
                if pid.isdigit() and not _process_alive(int(pid)):
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


def _num_matching(checksums: Sequence[Checksum]) -> int:
    """How many of `checksums` match before the first that does not."""
    return next((i for i, checksum in enumerate(checksums) if not checksum.matches()), len(checksums))


def _open_record(path: str, read_ahead: bool) -> int | None:
    """An open file (None if there is no such file), the kernel asked to read it ahead if `read_ahead`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    if read_ahead:
        _read_ahead(fd)
    return fd


def _read_ahead(fd: int | None) -> None:
    """Ask the kernel to start reading a file (a no-op where posix_fadvise is missing: macOS)."""
    if fd is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux: a read that returns only what the page cache holds


def _read_fd(fd: int) -> tuple[bytearray, bool]:
    """A whole open file, read into one writable buffer (the record's tensors are views of it), and whether the
    page cache held all of it (where that cannot be asked, False)."""
    data = bytearray(os.fstat(fd).st_size)
    view, done, cached = memoryview(data), 0, False
    if _NOWAIT is not None and data:
        try:
            done = os.preadv(fd, [view], 0, _NOWAIT)
            cached = done == len(data)
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a file system without it
            done = 0
    while done < len(data) and (n := os.preadv(fd, [view[done:]], done)):
        done += n
    return (data if done == len(data) else data[:done]), cached  # shrank under us: decode finds it truncated


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_new_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` (a temporary name of this writer's), readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _flush_at_exit(store: weakref.ref[DiskBlockStore]) -> None:
    """A clean exit first writes what is queued (daemon threads still run while atexit handlers do), then ends the
    writer thread."""
    if (alive := store()) is not None:
        alive.flush(EXIT_FLUSH_S)
        alive.stop_writer(EXIT_JOIN_S)


def _flush_tier_at_exit(tier: weakref.ref[DiskKVCache]) -> None:
    """A clean exit (SIGTERM to the server included) first writes what the pool holds that the disk lacks: the
    queued blocks and the skipped ones still in the pool (this runs before the store's own handler)."""
    if (alive := tier()) is not None:
        alive.flush(EXIT_FLUSH_S)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class DiskKVCache:
    """The disk tier as the KV cache manager sees it: pool blocks in and out by key, the store's files below."""

    def __init__(self, store: DiskBlockStore, cache: PagedKVCache):
        self.store = store
        self.cache = cache
        # Blocks skipped while the writer was behind: handed again once it has room, if the pool still holds them
        # (`pool_block` says which pool block holds a key now: the KV cache manager sets it), and at a clean exit.
        self._skipped: OrderedDict[BlockHash, tuple[BlockHash | None, tuple[int, ...]]] = OrderedDict()
        self.pool_block: Callable[[BlockHash], int | None] = lambda key: None
        self.specs = cache.block_specs()
        self.num_hit_tokens = 0  # prompt tokens whose blocks came from disk (the KV manager counts them)
        self.num_recomputed_tokens = 0  # tokens on disk the engine chose to prefill instead: faster than reading
        # measured rates (None until measured: reading is tried first), exponentially averaged
        self.read_bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self.record_bytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.specs)
        self._logged_recompute = False
        # One thread reads one prefix's records in order, after asking the kernel to read all its files ahead
        # (posix_fadvise WILLNEED: the disk sees them all at once). Several threads per prefix were slower: most
        # of a record's time out of the page cache is Python holding the GIL, and threads only contend for it.
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvserve-disk-reader")
        atexit.register(_flush_tier_at_exit, weakref.ref(self))

    def contains(self, key: BlockHash) -> bool:
        return self.store.contains(key)

    def save(self, block_id: int, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Copy a newly registered full block out of the pool for the writer (a memcpy on the step thread). A block
        the writer had no room for is remembered and handed again later (`save_skipped`)."""
        if self.store.writing_stopped:
            return
        if self._skipped:
            self.save_skipped()
        if not self.store.submit(BlockRecord(key, parent, tuple(token_ids), self.cache.export_block(block_id))) \
                and len(self._skipped) < MAX_SKIPPED:
            self._skipped[key] = (parent, tuple(token_ids))

    def save_skipped(self, timeout_s: float = 0.0) -> None:
        """Hand the writer the skipped blocks the pool still holds, oldest first, while it has room (waiting up to
        `timeout_s` for room). A block the pool no longer holds cannot be written: it is forgotten."""
        deadline = time.monotonic() + timeout_s
        while self._skipped and not self.store.writing_stopped:
            key, (parent, token_ids) = next(iter(self._skipped.items()))
            block_id = self.pool_block(key)
            if block_id is not None:
                if not self.store.wait_for_room(self.record_bytes, max(0.0, deadline - time.monotonic())):
                    return
                tensors = self.cache.export_block(block_id)
                # still that key's block after the copy: at exit an engine thread that has not stopped may be
                # reusing blocks, and a block it took while we copied must not be written under this key
                if self.pool_block(key) == block_id:
                    if not self.store.submit(BlockRecord(key, parent, token_ids, tensors)):
                        return
                    self.store.counters.num_writes_retried += 1
            del self._skipped[key]

    def flush(self, timeout_s: float) -> bool:
        """Write what the pool holds that the disk lacks: the queue, and the skipped blocks still in the pool
        (what a clean exit does, within `timeout_s`). False if time ran out first."""
        deadline = time.monotonic() + timeout_s
        self.save_skipped(timeout_s)
        return self.store.flush(max(0.0, deadline - time.monotonic())) and not self._skipped

    def worth_reading(self, num_records: int, num_tokens: int) -> bool:
        """Whether reading `num_records` records is faster than prefilling the `num_tokens` they save, at the rates
        measured so far; when it is not, the tokens are counted and the first time logged."""
        if self.read_bytes_per_s is None or self.prefill_tokens_per_s is None:
            return True
        read_s = num_records * self.record_bytes / self.read_bytes_per_s
        prefill_s = num_tokens / self.prefill_tokens_per_s
        if read_s <= prefill_s:
            return True
        self.num_recomputed_tokens += num_tokens
        if not self._logged_recompute:
            self._logged_recompute = True
            logger.info(f"KV disk cache: prefilling {num_tokens:,} tokens ({prefill_s:.3f} s at "
                        f"{self.prefill_tokens_per_s:,.0f} tokens/s) rather than reading them ({read_s:.3f} s at "
                        f"{self.read_bytes_per_s / 1e6:,.0f} MB/s); counted in kvserve:kv_disk_cache_recomputed_tokens")
        return False

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled `num_tokens` took `seconds` (the engine reports it: the rate loading competes with)."""
        self.prefill_tokens_per_s = _averaged(self.prefill_tokens_per_s, num_tokens / seconds)

    def start_reading(self, loads: Sequence[BlockLoad]) -> PrefixRead:
        """Read and check the records of `loads` on the reader threads; PrefixRead.finish puts them in the pool."""
        started = time.perf_counter()  # before the first read starts: a read may end before PrefixRead exists
        return PrefixRead(self, list(loads), self._readers.submit(self._read, list(loads)), started)

    def _read(self, loads: list[BlockLoad]) -> tuple[list[list[torch.Tensor]], float, int]:
        """The records of `loads` up to the first miss (the blocks after it would not be used), when the reads
        ended, and how many came from the writer's queue (no disk read: not in the measured read rate)."""
        found, num_queued = self.store.read_chain_counted([(load.key, load.parent, load.token_ids) for load in loads],
                                                          self.specs)
        return found, time.perf_counter(), num_queued

    def stats(self) -> dict[str, float | int]:
        return {**self.store.stats(), "disk_cache_hit_tokens": self.num_hit_tokens,
                "disk_cache_recomputed_tokens": self.num_recomputed_tokens}


def _averaged(average: float | None, value: float) -> float:
    """An exponential average that follows a rate over the last ten or so measurements."""
    return value if average is None else 0.9 * average + 0.1 * value


class PrefixRead:
    """A prefix's records being read on the reader threads, while the engine's steps go on."""

    def __init__(self, tier: DiskKVCache, loads: list[BlockLoad], read: Future, started_s: float):
        self.tier = tier
        self.loads = loads
        self._read = read
        self._started = started_s  # perf_counter() when the read was submitted

    def done(self) -> bool:
        return self._read.done()

    def wait(self, timeout_s: float) -> None:
        futures.wait([self._read], timeout_s)

    def finish(self) -> int:
        """Put the records read into their pool blocks, in order up to the first miss (once done); returns how many."""
        found, ended, num_queued = self._read.result()
        for load, tensors in zip(self.loads, found):
            self.tier.cache.import_block(load.block_id, tensors)
        num_loaded = len(found)
        read_s = ended - self._started
        self.tier.store.counters.read_s += read_s
        if num_loaded > num_queued:  # the rate of reading from disk: a block taken from the queue cost no read
            self.tier.read_bytes_per_s = _averaged(self.tier.read_bytes_per_s, (num_loaded - num_queued) *
                                                   self.tier.record_bytes / max(read_s, 1e-6))
        return num_loaded
