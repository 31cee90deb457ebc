"""The disk tier's store: records are owner-only, written once and found after a restart; a record is used only if
it is exactly the block asked for (corrupted, truncated, foreign and mismatched files are misses, counted, logged
once and removed); a full disk stops writing with one warning; the cap holds, least recently used first; records
appear only whole, even when the writing process is killed; two stores share a directory."""
import errno
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from kvserve.kv.tiers import store as store_module
from kvserve.kv.tiers.store import DiskBlockStore
from tests.kv.tiers.disk_records import BS, SPECS, as_bytes, chain, damage_flip, record, store, written

REPO = Path(__file__).resolve().parents[3]


def test_records_are_owner_only_and_found_after_a_restart(tmp_path):
    keys, tokens = chain(3)
    written(store(tmp_path), *(record(i, keys, tokens) for i in range(3)))
    files = list(tmp_path.glob("*/*.kvblock"))
    assert len(files) == 3 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert files[0].parent.stat().st_mode & 0o777 == 0o700
    again = store(tmp_path)
    assert again.start_line(BS, 1) == (f"KV disk cache: {tmp_path}, 1.00 GiB cap, 3 blocks (48 tokens) from "
                                       "earlier runs")
    assert as_bytes(again.read(keys[2], keys[1], tokens[2], SPECS)) == as_bytes(record(2, keys, tokens).tensors)


def test_each_block_is_written_once(tmp_path):
    keys, tokens = chain(1)
    s = store(tmp_path)
    written(s, record(0, keys, tokens))
    mtime = s.path(keys[0]).stat().st_mtime_ns
    written(s, record(0, keys, tokens))
    written(store(tmp_path), record(0, keys, tokens))
    assert s.counters.num_writes == 1 and s.path(keys[0]).stat().st_mtime_ns == mtime


def test_the_exit_handler_writes_the_queue_then_ends_the_writer_thread(tmp_path, monkeypatch):
    keys, tokens = chain(4)
    s = store(tmp_path)
    write = DiskBlockStore._write
    monkeypatch.setattr(DiskBlockStore, "_write", lambda self, r: time.sleep(0.05) or write(self, r))
    for i in range(4):
        s.submit(record(i, keys, tokens))
    writer = s.writer.thread
    assert writer is not None and writer.is_alive()
    store_module._flush_at_exit(weakref.ref(s))
    assert s.counters.num_writes == 4 and not writer.is_alive()  # nothing left running while Python finalizes
    assert s.submit(record(0, *chain(1, salt="after"))) and s.writer.thread is None  # an exiting store queues nothing


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def damage_foreign(path: Path) -> None:
    path.write_bytes(os.urandom(5000))


def damage_cut_in_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])  # the header's length field says more than the file holds


def damage_offsets(path: Path) -> None:
    """A well-formed header whose first tensor claims bytes past the end of the file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["t0"]["data_offsets"] = [0, 10**9]
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def damage_swap_tensors(path: Path) -> None:
    """Tensors t0 and t1 (same dtype and size) swapped in the header: every byte intact, in the wrong place."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["t0"]["data_offsets"], header["t1"]["data_offsets"] = header["t1"]["data_offsets"], header["t0"][
        "data_offsets"]
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


@pytest.mark.parametrize("damage, kind", [(damage_truncate, "corrupt"), (damage_flip, "corrupt"),
                                          (damage_foreign, "foreign"), (damage_cut_in_header, "foreign"),
                                          (damage_offsets, "corrupt"), (damage_swap_tensors, "corrupt")])
def test_damaged_records_are_misses_counted_logged_once_and_removed(tmp_path, caplog, damage, kind):
    keys, tokens = chain(3)
    s = store(tmp_path)
    written(s, *(record(i, keys, tokens) for i in range(3)))
    damage(s.path(keys[1]))
    damage(s.path(keys[2]))
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert s.read(keys[1], keys[0], tokens[1], SPECS) is None
        assert s.read(keys[2], keys[1], tokens[2], SPECS) is None
    assert s.counters.errors[kind] == 2
    assert caplog.text.count("rejected") == 1 and f"({kind}:" in caplog.text
    assert not s.path(keys[1]).exists() and not s.path(keys[2]).exists()
    assert s.read(keys[0], None, tokens[0], SPECS) is not None and s.stats()["disk_cache_blocks"] == 1

def test_another_fingerprint_never_finds_the_records(tmp_path):
    keys, tokens = chain(1)
    written(store(tmp_path), record(0, keys, tokens))
    other = store(tmp_path, name="model-b")
    assert not other.contains(keys[0]) and other.read(keys[0], None, tokens[0], SPECS) is None
    assert other.start_line(BS, 1).endswith("0 blocks (0 tokens) from earlier runs; 1 records of other models or "
                                            "formats share the cap")


def test_a_full_disk_stops_writing_with_one_warning_and_reads_go_on(tmp_path, monkeypatch, caplog):
    keys, tokens = chain(4)
    s = store(tmp_path)
    written(s, record(0, keys, tokens))

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "write_new_file", full)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        written(s, record(1, keys, tokens), record(2, keys, tokens))
        written(s, record(3, keys, tokens))
    assert s.writing_stopped and s.counters.errors["write"] == 1
    assert caplog.text.count("stopped") == 1 and "No space left on device" in caplog.text
    assert not list(tmp_path.glob("*/.tmp-*")) and not s.contains(keys[1])
    assert s.read(keys[0], None, tokens[0], SPECS) is not None


def test_an_unwritable_directory_is_an_error_at_start(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="--kv-disk-cache .*a-file/cache: cannot write there"):
        store(tmp_path / "a-file" / "cache")


def test_the_cap_holds_and_evicts_the_least_recently_used(tmp_path):
    keys, tokens = chain(6)
    measure = store(tmp_path / "measure")
    written(measure, record(1, keys, tokens))
    size = measure.index.nbytes  # records 1..5 are this size, record 0 (no parent) a little smaller
    tmp_path = tmp_path / "cache"
    s = store(tmp_path, capacity_bytes=3 * size)
    written(s, record(0, keys, tokens), record(1, keys, tokens), record(2, keys, tokens))
    assert s.read(keys[0], None, tokens[0], SPECS) is not None  # used: now the most recent
    written(s, record(3, keys, tokens))
    assert s.index.nbytes <= 3 * size and [s.contains(k) for k in keys[:4]] == [True, False, True, True]
    written(s, record(4, keys, tokens), record(5, keys, tokens))
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*/*.kvblock"))
    assert on_disk == s.index.nbytes <= 3 * size and s.counters.num_evicted == 3
    assert store(tmp_path, capacity_bytes=3 * size).start_line(BS, 1).endswith("3 blocks (48 tokens) from earlier runs")


# Writes each record in two halves 0.2 s apart, so a kill almost surely lands inside a write.
WRITER = """
import os, sys, time, torch
from kvserve.kv.tiers import store as store_module
from kvserve.kv.tiers.record import BlockRecord
from kvserve.kv.tiers.store import DiskBlockStore
from tests.kv.tiers.disk_records import chain, fingerprint

def slow_write(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data[: len(data) // 2])
    time.sleep(0.2)
    os.write(fd, data[len(data) // 2 :])
    os.close(fd)

store_module.write_new_file = slow_write
keys, tokens = chain(400)
store = DiskBlockStore(sys.argv[1], 1 << 40, fingerprint())
payload = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
print("ready", flush=True)
for i in range(400):
    store.submit(BlockRecord(keys[i], keys[i - 1] if i else None, tuple(tokens[i]), [payload]))
    store.flush()
"""


def test_a_writer_killed_mid_write_leaves_only_whole_records(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*/*.kvblock"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list(tmp_path.glob("*/.tmp-*")), "killed outside a write: the test did not test anything"
    s = store(tmp_path)
    assert not list(tmp_path.glob("*/.tmp-*")), "the dead writer's temporary file was not cleaned up"
    keys, tokens = chain(400)
    visible = [i for i in range(400) if s.contains(keys[i])]
    assert len(visible) >= 3 and visible == list(range(len(visible)))
    specs = [(torch.uint8, (1 << 20,))]
    assert all(s.read(keys[i], keys[i - 1] if i else None, tokens[i], specs) is not None for i in visible)
    assert sum(s.counters.errors.values()) == 0


def test_two_stores_on_one_directory_share_records_without_corrupting_them(tmp_path):
    keys, tokens = chain(40)
    first, second = store(tmp_path), store(tmp_path)
    for i in range(40):  # interleaved, overlapping: both write the even blocks
        if i % 2 == 0 or i < 20:
            first.submit(record(i, keys, tokens))
        if i % 2 == 0 or i >= 20:
            second.submit(record(i, keys, tokens))
    assert first.flush(10) and second.flush(10)
    assert first.counters.num_writes and second.counters.num_writes
    for reader in (first, second, store(tmp_path)):
        assert all(reader.read(keys[i], keys[i - 1] if i else None, tokens[i], SPECS) is not None for i in range(40))
    assert len(list(tmp_path.glob("*/*.kvblock"))) == 40 and sum(first.counters.errors.values()) == 0
