"""The disk tier's reader threads: daemon threads (exit never waits on one), a given number at a time, and a read
given up on hands its turn to the next even while it is still stuck."""
import threading
import time

from kvserve.kv.tiers.readers import ReaderThreads


def test_reads_run_a_given_number_at_a_time_and_an_abandoned_one_gives_its_turn_back():
    readers = ReaderThreads(1, "test-reader")
    stuck, started = threading.Event(), threading.Event()
    first = readers.submit(lambda: started.set() or stuck.wait())
    assert started.wait(10)
    second = readers.submit(lambda: threading.current_thread().daemon)
    time.sleep(0.2)
    assert not second.future.done()  # waits for the one turn
    first.abandon()
    assert second.future.result(timeout=10) is True  # ran on a daemon thread, while the first is still stuck
    assert not first.future.done()
    stuck.set()
    assert first.future.result(timeout=10) is True


def test_a_read_abandoned_before_its_turn_never_runs():
    readers = ReaderThreads(1, "test-reader")
    hold, ran = threading.Event(), []
    first = readers.submit(hold.wait)
    second = readers.submit(lambda: ran.append(1))
    second.abandon()
    hold.set()
    assert first.future.result(timeout=10) is True
    third = readers.submit(lambda: "third")
    assert third.future.result(timeout=10) == "third" and ran == []
