"""The disk tier's store: a block exported from the pool comes back bit for bit in every KV format; a record is
used only if it is exactly the block asked for (corrupted, truncated, foreign and mismatched files are misses,
counted, logged once and removed); a full disk stops writing with one warning; the cap holds, least recently used
first; records appear only whole, even when the writing process is killed; two stores share a directory. The KV
manager reads what the pool lacks into pool blocks, as many as it has free, up to the first bad record."""
import errno
import hashlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvserve.kv import disk_cache
from kvserve.kv.block_hash import hash_block, hash_full_blocks
from kvserve.kv.disk_cache import (BlockRecord, DiskBlockStore, DiskKVCache, RecordRejected, decode_record,
                                   record_metadata)
from kvserve.kv.formats import make_kv_cache
from kvserve.kv.kv_cache_manager import BlockLoad, KVCacheManager
from kvserve.planner.layout import KVLayout

FORMATS = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
BS, BLOCKS = 16, 6
REPO = Path(__file__).resolve().parents[2]


def fingerprint(name: str = "model-a") -> dict[str, str]:
    return {"model": name, "digest": hashlib.sha256(name.encode()).hexdigest()}


def store(directory: Path, capacity_bytes: int = 1 << 30, name: str = "model-a") -> DiskBlockStore:
    return DiskBlockStore(directory, capacity_bytes, fingerprint(name))


def random_cache(format_name: str, layout: KVLayout, seed: int = 0):
    """A cache of `format_name` whose block tensors hold random bytes (every bit pattern, NaNs included)."""
    cache = make_kv_cache(format_name, layout, BLOCKS, BS, 2, 16, torch.float32, compile=False)
    g = torch.Generator().manual_seed(seed)
    for tensor in cache._block_tensors():
        raw = tensor.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return cache


def chain(num_blocks: int, salt: str | None = None) -> tuple[list[bytes], list[list[int]]]:
    """Keys and token ids of a prompt of `num_blocks` full blocks."""
    tokens = [list(range(i * BS, (i + 1) * BS)) for i in range(num_blocks)]
    keys = []
    for block in tokens:
        keys.append(hash_block(keys[-1] if keys else None, block, salt, "float32"))
    return keys, tokens


def record(i: int, keys, tokens, nbytes: int = 4096) -> BlockRecord:
    g = torch.Generator().manual_seed(i)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return BlockRecord(keys[i], keys[i - 1] if i else None, tuple(tokens[i]), list(payload.chunk(2)))


SPECS = [(torch.uint8, (2048,))] * 2


def written(s: DiskBlockStore, *records: BlockRecord) -> None:
    for r in records:
        s.submit(r)
    assert s.flush(10)


def as_bytes(tensors) -> list[bytes]:
    return [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("layout", [KVLayout.uniform(2), KVLayout.from_layer_windows([32, None, 32, 32, None, 32])],
                         ids=["uniform", "hybrid"])
@pytest.mark.parametrize("format_name", FORMATS)
def test_pool_to_disk_to_pool_is_bitwise_in_every_format(tmp_path, format_name, layout):
    source, target = random_cache(format_name, layout, 0), random_cache(format_name, layout, 1)
    keys, tokens = chain(2)
    tier = DiskKVCache(store(tmp_path), source)
    tier.save(3, keys[1], keys[0], tokens[1])
    assert tier.store.flush(10)
    read = DiskKVCache(store(tmp_path), target).start_reading([BlockLoad(5, keys[1], keys[0], tokens[1])])
    read.wait(10)
    assert read.done() and read.finish() == 1
    assert as_bytes(target.export_block(5)) == as_bytes(source.export_block(3))
    assert len(source.export_block(3)) == len(source._block_tensors())  # int4: codes, scales and zero points
    others = [b for b in range(BLOCKS) if b != 5]
    assert as_bytes(target.export_block(others[0])) == as_bytes(random_cache(format_name, layout, 1).export_block(
        others[0]))  # only the block read into changed


def test_a_block_read_from_the_writers_queue_is_bitwise_and_no_measure_of_the_disk(tmp_path, monkeypatch):
    layout = KVLayout.uniform(2)
    source = random_cache("float32", layout, 0)
    keys, tokens = chain(1)
    held = threading.Event()
    write = DiskBlockStore._write
    monkeypatch.setattr(DiskBlockStore, "_write", lambda self, r: held.wait(10) and write(self, r))
    tier = DiskKVCache(store(tmp_path), source)
    tier.save(3, keys[0], None, tokens[0])
    assert tier.contains(keys[0]) and not tier.store.path(keys[0]).exists()
    read = tier.start_reading([BlockLoad(5, keys[0], None, tokens[0])])
    read.wait(10)
    assert read.finish() == 1 and tier.store.counters.num_queued_reads == 1
    assert tier.read_bytes_per_s is None  # a memory copy says nothing of how fast the disk reads
    assert as_bytes(source.export_block(5)) == as_bytes(source.export_block(3))  # block 5 was other random bytes
    held.set()
    assert tier.store.flush(10)


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
    writer = s._writer
    assert writer is not None and writer.is_alive()
    disk_cache._flush_at_exit(weakref.ref(s))
    assert s.counters.num_writes == 4 and not writer.is_alive()  # nothing left running while Python finalizes
    assert s.submit(record(0, *chain(1, salt="after"))) and s._writer is None  # an exiting store queues nothing


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor bytes
    path.write_bytes(bytes(data))


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


def test_a_record_still_queued_for_the_writer_is_found_and_read_from_memory(tmp_path, monkeypatch):
    """A block registered a moment ago and not yet written (the writer thread behind the step thread) is a hit:
    the lookup finds it and a read takes its tensors from the queue, in order with the records on disk; a queued
    record is taken only for its own parent and tokens. CI's tiers test once recomputed half its histories so."""
    keys, tokens = chain(4)
    s = store(tmp_path)
    written(s, record(0, keys, tokens), record(1, keys, tokens))  # on disk
    held = threading.Event()
    write = DiskBlockStore._write
    monkeypatch.setattr(DiskBlockStore, "_write", lambda self, r: held.wait(10) and write(self, r))
    s.submit(record(2, keys, tokens))
    s.submit(record(3, keys, tokens))
    assert not s.path(keys[2]).exists() and s.contains(keys[2]) and s.contains(keys[3])
    asked = [(keys[i], keys[i - 1] if i else None, tokens[i]) for i in range(4)]
    found = s.read_chain(asked, SPECS)
    assert [as_bytes(t) for t in found] == [as_bytes(record(i, keys, tokens).tensors) for i in range(4)]
    assert (s.counters.num_reads, s.counters.num_queued_reads) == (2, 2)
    assert s.counters.bytes_read == s.counters.bytes_written  # the two records on disk, not the queued ones
    assert len(s.read_chain([*asked[:3], (keys[3], keys[3], tokens[3])], SPECS)) == 3  # another parent: a miss
    assert len(s.read_chain([*asked[:3], (keys[3], keys[2], [0] * BS)], SPECS)) == 3  # other tokens: a miss
    held.set()
    assert s.flush(10) and s.path(keys[3]).exists() and not s._pending
    reads, queued = s.counters.num_reads, s.counters.num_queued_reads
    assert len(s.read_chain(asked, SPECS)) == 4  # from disk once written
    assert (s.counters.num_reads, s.counters.num_queued_reads) == (reads + 4, queued)

@pytest.mark.parametrize("bad", [0, 3, 8, 11, 19])  # in the first, a middle or the last of the checker's batches
def test_a_chain_stops_at_its_first_bad_checksum_wherever_it_falls(tmp_path, bad):
    keys, tokens = chain(20)
    s = store(tmp_path)
    written(s, *(record(i, keys, tokens) for i in range(20)))
    damage_flip(s.path(keys[bad]))
    found = s.read_chain([(keys[i], keys[i - 1] if i else None, tokens[i]) for i in range(20)], SPECS)
    assert [as_bytes(t) for t in found] == [as_bytes(record(i, keys, tokens).tensors) for i in range(bad)]
    assert s.counters.errors["corrupt"] == 1 and s.counters.num_reads == bad and not s.path(keys[bad]).exists()
    assert all(s.contains(keys[i]) for i in range(20) if i != bad)


def test_a_record_is_used_only_for_its_own_parent_tokens_and_model(tmp_path):
    keys, tokens = chain(2)
    s = store(tmp_path)
    written(s, record(1, keys, tokens))
    data = s.path(keys[1]).read_bytes()
    with pytest.raises(RecordRejected, match="token_ids") as wrong_tokens:
        decode_record(data, s.fingerprint, keys[1], keys[0], [0] * BS, SPECS)
    with pytest.raises(RecordRejected, match="parent") as wrong_parent:
        decode_record(data, s.fingerprint, keys[1], keys[1], tokens[1], SPECS)
    with pytest.raises(RecordRejected, match="dtypes or shapes"):
        decode_record(data, s.fingerprint, keys[1], keys[0], tokens[1], [(torch.uint8, (4096,))])
    with pytest.raises(RecordRejected, match="another model") as other_model:
        decode_record(data, fingerprint("model-b")["digest"], keys[1], keys[0], tokens[1], SPECS)
    assert (wrong_tokens.value.kind, wrong_parent.value.kind, other_model.value.kind) == ("mismatch",) * 2 + (
        "foreign",)
    assert record_metadata(data)["token_ids"] == str(tokens[1])


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

    monkeypatch.setattr(disk_cache, "_write_new_file", full)
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
    size = measure.nbytes  # records 1..5 are this size, record 0 (no parent) a little smaller
    tmp_path = tmp_path / "cache"
    s = store(tmp_path, capacity_bytes=3 * size)
    written(s, record(0, keys, tokens), record(1, keys, tokens), record(2, keys, tokens))
    assert s.read(keys[0], None, tokens[0], SPECS) is not None  # used: now the most recent
    written(s, record(3, keys, tokens))
    assert s.nbytes <= 3 * size and [s.contains(k) for k in keys[:4]] == [True, False, True, True]
    written(s, record(4, keys, tokens), record(5, keys, tokens))
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*/*.kvblock"))
    assert on_disk == s.nbytes <= 3 * size and s.counters.num_evicted == 3
    assert store(tmp_path, capacity_bytes=3 * size).start_line(BS, 1).endswith("3 blocks (48 tokens) from earlier runs")


# Writes each record in two halves 0.2 s apart, so a kill almost surely lands inside a write.
WRITER = """
import os, sys, time, torch
from kvserve.kv import disk_cache
from kvserve.kv.disk_cache import BlockRecord, DiskBlockStore
from tests.kv.test_disk_cache import chain, fingerprint

def slow_write(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data[: len(data) // 2])
    time.sleep(0.2)
    os.write(fd, data[len(data) // 2 :])
    os.close(fd)

disk_cache._write_new_file = slow_write
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


# ---- the KV cache manager continuing the pool's hit on disk (a stand-in tier: every record present) -----------
class StandInRead:
    def __init__(self, loads, bad_key):
        self.loads = loads
        self.bad_key = bad_key

    def done(self) -> bool:
        return True

    def finish(self) -> int:
        keys = [load.key for load in self.loads]
        return keys.index(self.bad_key) if self.bad_key in keys else len(keys)


class StandInTier:
    def __init__(self, bad_key: bytes | None = None):
        self.bad_key = bad_key
        self.num_hit_tokens = 0
        self.reads: list[list[int]] = []

    def contains(self, key: bytes) -> bool:
        return True

    def worth_reading(self, num_records: int, num_tokens: int) -> bool:
        return True

    def start_reading(self, loads):
        self.reads.append([load.block_id for load in loads])
        return StandInRead(loads, self.bad_key)


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def manager_with_pool_hits(num_blocks: int, num_pool_hits: int, tier) -> tuple[KVCacheManager, Seq, list[bytes]]:
    """A manager whose pool caches the first `num_pool_hits` blocks of a 97-token prompt (6 full blocks)."""
    kv = KVCacheManager(num_blocks, BS, disk=tier)
    seq = Seq("r", list(range(97)))
    keys = hash_full_blocks(seq.token_ids, BS)
    for block, key in zip(kv.pool.allocate(num_pool_hits), keys):
        kv.pool.register(block, key)
        kv.pool.free([block])
    return kv, seq, keys


def test_the_manager_reads_what_the_pool_lacks_and_admission_takes_it():
    tier = StandInTier()
    kv, seq, keys = manager_with_pool_hits(16, 2, tier)
    assert kv.prefix_loading(seq) and kv.pool.num_used_blocks == 2 + 4  # the pool's hits held, 4 blocks read into
    kv.collect_loads()
    assert not kv.prefix_loading(seq) and kv.pool.num_used_blocks == 0
    assert kv.find_cached_prefix(seq).num_blocks == 6 and tier.num_hit_tokens == 4 * BS


def test_a_pool_short_of_blocks_reads_what_fits():
    tier = StandInTier()
    kv, seq, _ = manager_with_pool_hits(4, 2, tier)  # 2 free blocks once the 2 hits are held
    assert kv.prefix_loading(seq) and len(tier.reads[0]) == 2
    kv.collect_loads()
    assert kv.find_cached_prefix(seq).num_blocks == 4 and kv.pool.num_used_blocks == 0
    assert not kv.prefix_loading(seq)  # one read per admission, even though the disk holds more


def test_a_read_failing_halfway_keeps_the_blocks_before_it_and_frees_the_rest():
    keys = hash_full_blocks(list(range(97)), BS)
    kv, seq, _ = manager_with_pool_hits(16, 1, StandInTier(bad_key=keys[3]))
    assert kv.prefix_loading(seq)
    kv.collect_loads()
    assert kv.find_cached_prefix(seq).num_blocks == 3
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_cached_blocks == 3


def test_freeing_a_request_whose_prefix_is_being_read_gives_its_blocks_back():
    kv, seq, _ = manager_with_pool_hits(16, 2, StandInTier())
    assert kv.prefix_loading(seq)
    kv.free(seq)
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_cached_blocks == 2
    kv.collect_loads()  # nothing left to collect
    assert kv.pool.num_used_blocks == 0
