"""Files kvserve keeps for itself between starts (saved graphs, the matmul routes, compile times): read only where
this user owns them and no one else may write them, written atomically as files only this user may read or write."""
from __future__ import annotations

import os
from pathlib import Path


def not_private(path: Path) -> str | None:
    """Why the file or its directory is not this user's own (None: it is; a part that does not exist yet is no
    reason)."""
    for item in (path, path.parent):
        if not item.exists():
            continue
        info = item.stat()
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            return f"{item} belongs to another user"
        if info.st_mode & 0o022:
            return f"{item} may be written by other users"
    return None


def private_directory(directory: Path) -> None:
    """`directory`, and each of its parents that does not exist yet, made for this user alone (mkdir's mode applies
    to the last part only)."""
    for part in reversed([directory, *directory.parents]):
        if not part.exists():
            part.mkdir(mode=0o700, exist_ok=True)


def write_private(path: Path, text: str) -> None:
    """Atomically (another engine may start beside this one), in a directory only this user may enter, as a file
    only this user may read or write."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.replace(partial, path)
