"""What the disk tier does with a record it must not use: count it by kind, log the first of each kind, and remove
it; one that cannot be removed (a read-only file system, a directory in its place) is skipped from then on rather
than read and rejected again, and a record whose read was abandoned as too slow is skipped too. Rejections that are
no fault of the file (out of file descriptors, an error the tier did not foresee) leave it in place."""
from __future__ import annotations

import logging
import os
import threading

from kvserve.kv.tiers.files import remove
from kvserve.kv.tiers.record import RecordRejected

logger = logging.getLogger("kvserve")

LEFT_IN_PLACE = ("fd_limit", "timeout", "unexpected")


class Rejections:
    """Counts into `errors` (kind -> records); `skipped` holds the paths never to be read again by this process."""

    def __init__(self, errors: dict[str, int]):
        self.errors = errors
        self.skipped: set[str] = set()
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # rejections come from several reader threads

    def reject(self, path: str, rejected: RecordRejected) -> None:
        """Count, log once per kind, and remove the file (or skip it, where it cannot be removed or must stay)."""
        if rejected.kind == "timeout":
            self.skipped.add(path)
        fate = "left in place" if rejected.kind in LEFT_IN_PLACE else self._remove(path)
        if self._count(rejected.kind):
            logger.warning(f"KV disk cache: {os.path.basename(path)} rejected ({rejected.kind}: {rejected}); read as "
                           f"a miss and {fate} (later {rejected.kind} records are only counted: "
                           "kvserve:kv_disk_cache_errors)")

    def skips(self, path: str) -> bool:
        """Whether `path` is never to be read again (it could not be removed, or its read was abandoned)."""
        return path in self.skipped

    def _remove(self, path: str) -> str:
        """Remove a rejected file; what became of it."""
        try:
            remove(path)
            return "removed"
        except OSError as exc:
            self.skipped.add(path)
            self._count("unremovable")
            return f"skipped from now on: it cannot be removed ({type(exc).__name__}: {exc.strerror or exc})"

    def _count(self, kind: str) -> bool:
        """Count one error of `kind`; whether it is the first (to log)."""
        with self._lock:
            self.errors[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        return first
