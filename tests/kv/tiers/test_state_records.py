"""A hybrid model's state checkpoints in the disk tier's store: a record kind of their own beside the block they end
(same name, another suffix), found after a restart and read back bitwise; read with other shapes (a model whose
linear layers differ), as a block, or larger than a state can be, it is a miss, counted by kind and removed."""
import shutil
import threading

import torch

from kvserve.kv.tiers.record import BLOCK, STATE, BlockRecord
from kvserve.kv.tiers.store import DiskBlockStore
from tests.kv.tiers.disk_records import BS, SPECS, as_bytes, chain, record, store, written

STATE_SPECS = [(torch.float32, (3, 96, 3)), (torch.float32, (3, 4, 16, 8))]


def state_record(i: int, keys, tokens, specs=STATE_SPECS) -> BlockRecord:
    g = torch.Generator().manual_seed(100 + i)
    tensors = [torch.randn(shape, generator=g, dtype=dtype) for dtype, shape in specs]
    return BlockRecord(keys[i], keys[i - 1] if i else None, tuple(tokens[i]), tensors, STATE)


def read_state(s, i, keys, tokens, specs=STATE_SPECS):
    found, _ = s.chain_read([(keys[i], keys[i - 1] if i else None, tokens[i])], specs, STATE).run()
    return found[0] if found else None


def test_a_state_record_sits_beside_its_block_and_is_found_after_a_restart(tmp_path):
    keys, tokens = chain(2)
    s = store(tmp_path)
    written(s, record(1, keys, tokens), state_record(1, keys, tokens))
    assert s.path(keys[1], STATE).with_suffix(BLOCK.suffix) == s.path(keys[1])
    assert s.contains(keys[1], STATE) and not s.contains(keys[0], STATE)
    again = store(tmp_path)
    assert again.start_line(BS, 1).endswith("1 block (16 tokens) and 1 state checkpoint from earlier runs")
    stats = again.stats()
    assert (stats["disk_cache_blocks"], stats["disk_cache_state_checkpoints"]) == (1, 1)
    assert as_bytes(read_state(again, 1, keys, tokens)) == as_bytes(state_record(1, keys, tokens).tensors)
    assert as_bytes(again.read(keys[1], keys[0], tokens[1], SPECS)) == as_bytes(record(1, keys, tokens).tensors)


def test_a_queued_state_is_read_from_memory_apart_from_its_block(tmp_path, monkeypatch):
    keys, tokens = chain(1)
    s = store(tmp_path)
    held = threading.Event()  # the writer waits: both records stay queued
    write = DiskBlockStore._write
    monkeypatch.setattr(DiskBlockStore, "_write", lambda self, r: held.wait(10) and write(self, r))
    s.submit(record(0, keys, tokens))
    s.submit(state_record(0, keys, tokens))
    assert len(s.writer.pending) == 2 and s.contains(keys[0], STATE)
    assert as_bytes(read_state(s, 0, keys, tokens)) == as_bytes(state_record(0, keys, tokens).tensors)
    assert s.counters.num_queued_reads == 1 and not s.path(keys[0], STATE).exists()
    held.set()
    assert s.flush(10) and s.path(keys[0], STATE).exists() and s.path(keys[0]).exists()


def test_a_state_of_other_shapes_is_a_mismatch_and_removed(tmp_path):
    keys, tokens = chain(1)
    s = store(tmp_path)
    written(s, state_record(0, keys, tokens))
    other = [(torch.float32, (3, 96, 3)), (torch.float32, (3, 4, 16, 16))]  # wider value heads
    assert read_state(s, 0, keys, tokens, other) is None
    assert s.counters.errors["mismatch"] == 1 and not s.path(keys[0], STATE).exists()


def test_a_block_record_in_a_state_records_place_is_foreign(tmp_path):
    keys, tokens = chain(1)
    s = store(tmp_path)
    written(s, record(0, keys, tokens))
    shutil.copy(s.path(keys[0]), s.path(keys[0], STATE))
    assert read_state(s, 0, keys, tokens, SPECS) is None  # even with the block's own shapes
    assert s.counters.errors["foreign"] == 1 and s.path(keys[0]).exists()


def test_a_state_record_larger_than_a_state_can_be_is_rejected_unread(tmp_path):
    keys, tokens = chain(1)
    s = store(tmp_path)
    big = [(torch.float32, (3, 96, 3)), (torch.float32, (3, 4, 16, 64))]
    written(s, state_record(0, keys, tokens, big))
    assert read_state(s, 0, keys, tokens) is None
    assert s.counters.errors["oversized"] == 1 and s.counters.num_reads == 0
