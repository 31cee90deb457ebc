"""Reading a prefix's records in order: a record still queued for the writer is read from memory, in order with
the records on disk; a chain stops at its first bad checksum wherever it falls among the checker's batches."""
import threading

import pytest

from kvserve.kv.tiers.store import DiskBlockStore
from tests.kv.tiers.disk_records import BS, SPECS, as_bytes, chain, damage_flip, record, store, written


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
    assert s.flush(10) and s.path(keys[3]).exists() and not s.writer.pending
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
