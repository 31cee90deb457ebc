"""The disk tier adapter: a block exported from the pool comes back bit for bit in every KV format and a hybrid
layout, through the disk or still from the writer's queue (which says nothing of the disk's read rate)."""
import threading

import pytest

from kvserve.kv.tiers.base import BlockLoad
from kvserve.kv.tiers.disk import DiskKVCache
from kvserve.kv.tiers.store import DiskBlockStore
from kvserve.planner.layout import KVLayout
from tests.kv.tiers.disk_records import BLOCKS, as_bytes, chain, random_cache, store

FORMATS = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]


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
    assert tier.cost.read_bytes_per_s is None  # a memory copy says nothing of how fast the disk reads
    assert as_bytes(source.export_block(5)) == as_bytes(source.export_block(3))  # block 5 was other random bytes
    held.set()
    assert tier.store.flush(10)
