"""The disk tier's directory: created owner-only and trusted only if the serving user alone can write it (as ssh
trusts ~/.ssh), its dead writers' temporary files removed, and its records listed without following symlinks."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from kvserve.kv.tiers.files import process_alive, write_new_file
from kvserve.kv.tiers.record import BLOCK, STATE

RECORD_SUFFIXES = (BLOCK.suffix, STATE.suffix)
TEMP_PREFIX = ".tmp-"


def open_directory(root: Path, directory: Path, fingerprint: dict[str, str]) -> None:
    """Create `root` and its fingerprint's `directory` (owner only), refuse either if another user owns it or others
    may write it, and prove `directory` takes a file: an unusable directory fails here, clearly."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # (mkdir gives parents the default mode)
        check_trusted(root, root)
        directory.mkdir(mode=0o700, exist_ok=True)
        check_trusted(directory, root)
        temp = directory / f"{TEMP_PREFIX}{os.getpid()}-start"
        write_new_file(temp, json.dumps(fingerprint, indent=1, sort_keys=True).encode())
        os.replace(temp, directory / "model.json")
    except OSError as exc:
        raise ValueError(f"--kv-disk-cache {root}: cannot write there ({type(exc).__name__}: "
                         f"{exc.strerror or exc})") from exc


def check_trusted(path: Path, root: Path) -> None:
    """Raise ValueError unless `path` is a directory the serving user owns and only it may write: whoever else can
    write there can make the server read K/V of their choosing (records carry a CRC-32, no signature)."""
    info = os.stat(path)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid == os.geteuid() and not mode & 0o022:
        return
    if info.st_uid != os.geteuid():
        why, fix = f"owned by uid {info.st_uid}, not the serving user's uid {os.geteuid()}", \
            f"use a directory you own (`chmod 700 {path}` once it is yours)"
    else:
        why, fix = "writable by group or others", f"run `chmod 700 {path}`, or use a directory you own"
    raise ValueError(f"--kv-disk-cache {root}: {path} is {why} (owner uid {info.st_uid}, mode {mode:04o}); whoever "
                     f"else can write there could make the server serve wrong K/V: {fix}")


def remove_dead_writers_temps(root: Path) -> None:
    """Temporary files of processes that died mid-write (named .tmp-PID-...); live writers' are left alone."""
    for directory in _subdirectories(root):
        for entry in _entries(directory):
            pid = entry.name.removeprefix(TEMP_PREFIX).split("-")[0]
            if entry.name.startswith(TEMP_PREFIX) and pid.isdigit() and not process_alive(int(pid)):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass


def scan_records(root: Path) -> list[tuple[int, str, int]]:
    """(mtime in ns, path, size) of every record under `root`: regular files only, symlinks not followed (a record
    read opens only a regular file too). An empty list if `root` is gone."""
    found = []
    for directory in _subdirectories(root):
        for entry in _entries(directory):
            if entry.name.endswith(RECORD_SUFFIXES):
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    found.append((info.st_mtime_ns, entry.path, info.st_size))
    return found


def _subdirectories(root: Path) -> list[str]:
    """Each fingerprint's directory under `root` (not a symlink to one)."""
    return [entry.path for entry in _entries(root) if entry.is_dir(follow_symlinks=False)]


def _entries(directory: str | Path) -> list[os.DirEntry]:
    """A directory's entries; none if it is gone (removed under us)."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
