"""Entries in place of a record that no writer of ours made, as real files: a directory, a sparse file far larger
than a record, a FIFO, a symlink, a record that cannot be removed, no file descriptor left. Each is a miss, counted
by kind and logged once, never an exception out of the read, never a blocked reader; the next read goes on."""
import errno
import logging
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvserve.kv.tiers import rejections as rejections_module
from tests.kv.tiers.disk_records import SPECS, chain, damage_flip, record, store, written

REPO = Path(__file__).resolve().parents[3]


def three_records(tmp_path):
    keys, tokens = chain(3)
    s = store(tmp_path)
    written(s, *(record(i, keys, tokens) for i in range(3)))
    return s, keys, tokens


def read_second(s, keys, tokens):
    """Read the second record on a thread of its own: a read that blocks fails the test instead of hanging it."""
    result = []
    reader = threading.Thread(target=lambda: result.append(s.read(keys[1], keys[0], tokens[1], SPECS)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the read blocked"
    return result[0]


def test_a_directory_in_place_of_a_record_is_a_miss_skipped_from_then_on(tmp_path, caplog):
    s, keys, tokens = three_records(tmp_path)
    path = s.path(keys[1])
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert read_second(s, keys, tokens) is None
        assert not s.contains(keys[1])  # a directory cannot be unlinked (EISDIR, root too): skipped, not retried
        assert read_second(s, keys, tokens) is None
    assert s.counters.errors["not_regular"] == 1 and s.counters.errors["unremovable"] == 1
    assert caplog.text.count("rejected (not_regular") == 1 and caplog.text.count("cannot be removed") == 1
    assert path.is_dir() and s.read(keys[2], keys[1], tokens[2], SPECS) is not None


def test_a_sparse_file_larger_than_any_record_is_rejected_unread_and_removed(tmp_path):
    s, keys, tokens = three_records(tmp_path)
    path = s.path(keys[1])
    with open(path, "r+b") as file:
        file.truncate(1 << 40)  # 1 TiB, no block of it on disk
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert read_second(s, keys, tokens) is None
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
    assert grown_kib < 50 * 1024, f"the process grew by {grown_kib:,} KiB reading it"
    assert s.counters.errors["oversized"] == 1 and not path.exists()


def test_a_fifo_in_place_of_a_record_never_blocks_the_reader(tmp_path):
    s, keys, tokens = three_records(tmp_path)
    path = s.path(keys[1])
    path.unlink()
    os.mkfifo(path)
    assert read_second(s, keys, tokens) is None
    assert s.counters.errors["not_regular"] == 1 and not path.exists()
    assert s.read(keys[0], None, tokens[0], SPECS) is not None


def test_a_symlinked_record_is_not_followed(tmp_path):
    s, keys, tokens = three_records(tmp_path)
    path, target = s.path(keys[1]), tmp_path / "elsewhere.kvblock"
    os.replace(path, target)  # a valid record, even: only a regular file at the record's own path is read
    path.symlink_to(target)
    assert read_second(s, keys, tokens) is None
    assert s.counters.errors["not_regular"] == 1 and not path.is_symlink() and target.exists()


def test_a_record_that_cannot_be_removed_is_counted_once_and_skipped(tmp_path, monkeypatch, caplog):
    s, keys, tokens = three_records(tmp_path)
    damage_flip(s.path(keys[1]))

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rejections_module, "remove", read_only)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert read_second(s, keys, tokens) is None
    assert not s.contains(keys[1]) and s.path(keys[1]).exists()
    assert s.counters.errors["corrupt"] == 1 and s.counters.errors["unremovable"] == 1
    assert "Read-only file system" in caplog.text and "skipped from now on" in caplog.text
    assert read_second(s, keys, tokens) is None and s.counters.errors["corrupt"] == 1  # not read again


OUT_OF_FDS = """
import resource, sys
from pathlib import Path
from tests.kv.tiers.disk_records import SPECS, chain, record, store, written

keys, tokens = chain(2)
s = store(Path(sys.argv[1]))
written(s, *(record(i, keys, tokens) for i in range(2)))
import os
num_open = len(os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (num_open - 1, hard))  # (listdir's own descriptor is closed again)
missed = s.read(keys[1], keys[0], tokens[1], SPECS) is None
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
found = s.read(keys[1], keys[0], tokens[1], SPECS) is not None
print(missed, found, s.counters.errors["fd_limit"], s.path(keys[1]).exists())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc (Linux)")
def test_no_file_descriptor_left_is_a_miss_that_leaves_the_record(tmp_path):
    done = subprocess.run([sys.executable, "-c", OUT_OF_FDS, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "1", "True"]  # missed, found once fds were back, kept
