"""What the disk tier's store knows of its directory: every record's path and size under the root, least recently
used first, so that it can hold a cap shared by every model and process in the directory. Not thread-safe: the
store calls it under its lock."""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path

from kvserve.kv.tiers.directory import scan_records
from kvserve.kv.tiers.files import remove
from kvserve.kv.tiers.record import STATE

RESCAN_S = 10.0  # when evicting, see other processes' records at most this often


class RecordIndex:
    """The records under `root` (`directory`'s are this fingerprint's own), their bytes in all, in LRU order."""

    def __init__(self, root: Path, directory: str):
        self.root = root
        self.directory = directory
        self.files: OrderedDict[str, int] = OrderedDict()  # every record's path under root, least recently used first
        self.nbytes = 0
        self.num_own_records = 0  # of those, this fingerprint's blocks
        self.num_own_states = 0  # ... and its state checkpoints (hybrid models)
        self.scanned_at = 0.0

    def scan(self) -> None:
        """Every record under root, ordered by last use (mtime)."""
        self.files.clear()
        self.nbytes = self.num_own_records = self.num_own_states = 0
        for _, path, size in sorted(scan_records(self.root), key=lambda found: found[0]):
            self.remember(path, size)
        self.scanned_at = time.monotonic()

    def remember(self, path: str, size: int) -> None:
        if path not in self.files:
            self.files[path] = size
            self.nbytes += size
            self._count_own(path, 1)

    def forget(self, path: str) -> None:
        size = self.files.pop(path, None)
        if size is not None:
            self.nbytes -= size
            self._count_own(path, -1)

    def _count_own(self, path: str, change: int) -> None:
        if os.path.dirname(path) == self.directory:
            if path.endswith(STATE.suffix):
                self.num_own_states += change
            else:
                self.num_own_records += change

    def touch(self, path: str) -> None:
        """`path` was used: last to be evicted."""
        if path in self.files:
            self.files.move_to_end(path)

    def make_room(self, num_bytes: int, capacity_bytes: int) -> int:
        """Remove least recently used records until `num_bytes` more fit under `capacity_bytes`; returns how many
        were removed (raises OSError where one cannot be: the writer then stops)."""
        if self.nbytes + num_bytes > capacity_bytes and time.monotonic() - self.scanned_at > RESCAN_S:
            self.scan()  # count what other processes wrote since
        num_removed = 0
        while self.files and self.nbytes + num_bytes > capacity_bytes:
            oldest = next(iter(self.files))
            self.forget(oldest)
            remove(oldest)
            num_removed += 1
        return num_removed

    def forget_if_gone(self) -> None:
        """If this fingerprint's directory is gone (removed under us), its records are too: counted no more (nor
        any other's, if the root went with it)."""
        if not self.files or os.path.isdir(self.directory):
            return
        gone = list(self.files) if not self.root.is_dir() else [
            path for path in self.files if os.path.dirname(path) == self.directory]
        for path in gone:
            self.forget(path)
