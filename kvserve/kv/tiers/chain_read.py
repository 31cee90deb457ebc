"""Reading one prefix's records in order, up to the first miss, on one thread: the next READ_AHEAD records are kept
open ahead of the one being read; once a record is found outside the page cache, the kernel is asked to read those
ahead too (posix_fadvise WILLNEED), so the disk sees many at once rather than one file's latency at a time (while
records come from the page cache the hint costs a walk over their cached pages and saves nothing). Checksums run on
the store's checker thread, CHECK_BATCH records at a time, while this thread reads the next records: zlib releases
the GIL while it runs. A record that cannot be opened (a symlink, no file descriptor left...) is a miss, counted by
the store like a rejected one."""
from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.tiers.files import open_record, read_ahead
from kvserve.kv.tiers.record import BLOCK, BlockRecord, Checksum, RecordKind, RecordRejected

READ_AHEAD = 32  # records of a prefix opened (and, once one comes from the disk, hinted) ahead of the one being read
CHECK_BATCH = 8  # records whose checksums the checker thread takes at once (a task per record costs more than it saves)

Specs = Sequence[tuple[torch.dtype, tuple[int, ...]]]
ChainLink = tuple[BlockHash, BlockHash | None, Sequence[int]]  # a record asked for: key, parent key, token ids


class _Queued:
    """The checksum of a record read from the writer's queue: this process's own bytes, nothing to check."""

    @staticmethod
    def matches() -> bool:
        return True


_QUEUED = _Queued()


def _num_matching(checksums: Sequence[Checksum]) -> int:
    """How many of `checksums` match before the first that does not."""
    return next((i for i, checksum in enumerate(checksums) if not checksum.matches()), len(checksums))


def unopened(exc: OSError) -> RecordRejected:
    """Why a record could not be opened, by kind: a symlink (not followed), no file descriptor left, else a read
    error."""
    kind = {errno.ELOOP: "not_regular", errno.EMFILE: "fd_limit", errno.ENFILE: "fd_limit"}.get(exc.errno, "read")
    return RecordRejected(kind, f"cannot open it ({type(exc).__name__}: {exc.strerror or exc})")


def _open(path: str, ahead: bool) -> int | OSError | None:
    """An open record, None if there is none, or why it could not be opened (handled when its turn comes)."""
    try:
        return open_record(path, ahead)
    except OSError as exc:
        return exc


def _close(fd: int | OSError | None) -> None:
    if isinstance(fd, int):
        os.close(fd)


class RecordSource(Protocol):
    """What a chain read asks of the store, one record at a time."""

    def record_file(self, key: BlockHash, kind: RecordKind) -> str: ...

    def queued(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
               kind: RecordKind) -> BlockRecord | None: ...

    def read_record(self, fd: int, path: str, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
                    specs: Specs, kind: RecordKind) -> tuple[tuple[list[torch.Tensor], Checksum, int] | None, bool]: ...

    def reject(self, path: str, rejected: RecordRejected) -> None: ...

    def skips(self, path: str) -> bool: ...

    def count_reads(self, num_reads: int, num_queued_reads: int, num_bytes: int) -> None: ...


class ChainRead:
    """The records of `links` (a prefix's blocks, in order; or of `kind` STATE, the state checkpoints after them),
    verified, up to the first miss, and how many of them came from the writer's queue rather than from disk
    (`run`)."""

    def __init__(self, source: RecordSource, checker: ThreadPoolExecutor, links: Sequence[ChainLink], specs: Specs,
                 kind: RecordKind = BLOCK):
        self.source = source
        self.checker = checker
        self.links = links
        self.specs = specs
        self.kind = kind
        self.paths = [source.record_file(key, kind) for key, _, _ in links]
        # open files of the records after the one being read (None: missing; an OSError: could not be opened)
        self.ahead: deque[int | OSError | None] = deque()
        self.reading: str | None = None  # the record being read (a read abandoned as too slow skips it from then on)
        self.cold = False  # a record came from the disk: hint the kernel about every record ahead
        self.found: list[list[torch.Tensor]] = []
        self.checks: list[Future] = []  # each: how many of its batch of checksums match before the first that does not
        self.batch: list[Checksum] = []
        self.sizes: list[int] = []  # bytes read for each record found (0: taken from the writer's queue)
        self.queued_flags: list[bool] = []

    def run(self) -> tuple[list[list[torch.Tensor]], int]:
        try:
            for link, path in zip(self.links, self.paths):
                if not self._read_next(link, path):
                    break
        finally:
            for fd in self.ahead:
                _close(fd)
        if self.batch:
            self.checks.append(self.checker.submit(_num_matching, self.batch))
        self._cut_at_first_bad_checksum()
        num_found = len(self.found)
        num_queued = sum(self.queued_flags[:num_found])
        self.source.count_reads(num_found - num_queued, num_queued, sum(self.sizes[:num_found]))
        return self.found, num_queued

    def _open_ahead(self) -> None:
        while len(self.ahead) < READ_AHEAD and (n := len(self.found) + len(self.ahead)) < len(self.paths):
            self.ahead.append(_open(self.paths[n], self.cold))

    def _read_next(self, link: ChainLink, path: str) -> bool:
        """Take the next record, from the writer's queue or from its file; False on a miss."""
        key, parent, token_ids = link
        self.reading = path
        self._open_ahead()
        fd = self.ahead.popleft()
        queued = self.source.queued(key, parent, token_ids, self.kind)
        if queued is not None:  # still on its way to disk: this process's own copy, nothing to check
            _close(fd)
            self._add(queued.tensors, _QUEUED, 0, True)
            return True
        if fd is None:  # written since it was opened ahead (it was queued), or else evicted since the lookup
            fd = _open(path, self.cold)
        if fd is None or self.source.skips(path):  # evicted since the lookup saw it; or never to be read again
            _close(fd)
            return False
        if isinstance(fd, OSError):
            self.source.reject(path, unopened(fd))
            return False
        try:
            read, cached = self.source.read_record(fd, path, key, parent, token_ids, self.specs, self.kind)
        finally:
            os.close(fd)
        if not cached and not self.cold:
            self.cold = True
            for other in self.ahead:
                if isinstance(other, int):
                    read_ahead(other)
        if read is None:
            return False
        self._add(*read, False)
        return True

    def _add(self, tensors: list[torch.Tensor], checksum: Checksum, num_bytes: int, queued: bool) -> None:
        self.found.append(tensors)
        self.batch.append(checksum)
        self.sizes.append(num_bytes)
        self.queued_flags.append(queued)
        if len(self.batch) == CHECK_BATCH:
            self.checks.append(self.checker.submit(_num_matching, self.batch))
            self.batch = []

    def _cut_at_first_bad_checksum(self) -> None:
        """Drop the records from the first whose checksum fails on (rejected: counted, logged once, removed)."""
        for i, check in enumerate(self.checks):
            if (bad := i * CHECK_BATCH + check.result()) < min((i + 1) * CHECK_BATCH, len(self.found)):
                self.source.reject(self.paths[bad], RecordRejected("corrupt", "checksum mismatch"))
                del self.found[bad:]
                break
