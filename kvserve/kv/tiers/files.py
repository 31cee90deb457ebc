"""The file system calls of the disk tier's store: open a record (never blocking, never through a symlink; asking
the kernel to read it ahead), read a whole file into one buffer, write a new file owner-only, remove one, and
whether a writer's process is still alive."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from kvserve.kv.tiers.record import RecordRejected


# A FIFO opens without waiting for a writer; a symlink fails (ELOOP) rather than being followed.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_record(path: str, ahead: bool) -> int | None:
    """An open file (None if there is no such file), the kernel asked to read it ahead if `ahead`. Never blocks and
    never follows a symlink; raises OSError (ELOOP: a symlink, EMFILE: no file descriptor left...)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    if ahead:
        read_ahead(fd)
    return fd


def read_ahead(fd: int | None) -> None:
    """Ask the kernel to start reading a file (a no-op where posix_fadvise is missing: macOS)."""
    if fd is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def checked_size(fd: int, max_bytes: int) -> int:
    """An open file's size, if it is a regular file of at most `max_bytes` (else RecordRejected: nothing is read
    from a FIFO, a device or a directory, nor more than a record can be)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise RecordRejected("not_regular", f"not a regular file (mode {info.st_mode:o})")
    if info.st_size > max_bytes:
        raise RecordRejected("oversized", f"{info.st_size:,} bytes, more than a record can be ({max_bytes:,})")
    return info.st_size


_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux: a read that returns only what the page cache holds


def read_fd(fd: int, size: int) -> tuple[bytearray, bool]:
    """An open file of `size` bytes (its fstat's, checked by the caller), read into one writable buffer (the
    record's tensors are views of it), and whether the page cache held all of it (where that cannot be asked,
    False). Never more than `size` bytes, even if the file grew since."""
    data = bytearray(size)
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


def remove(path: str) -> None:
    """Remove a file; one already gone is not an error (raises OSError where it cannot be removed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_new_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` (a temporary name of this writer's), readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
