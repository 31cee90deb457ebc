"""The disk tier's reader threads: each prefix read on a daemon thread of its own, at most a given number at a time.
Daemon threads never hold up the interpreter's exit (a ThreadPoolExecutor's workers are joined at exit, so one stuck
in the kernel would hang it), and a read the tier stopped waiting for gives its turn to the next at once."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class ReaderThreads:
    """Runs reads on daemon threads, `num_threads` at a time, in the order submitted."""

    def __init__(self, num_threads: int, name: str):
        self._turns = threading.Semaphore(num_threads)
        self._name = name

    def submit(self, read: Callable[..., object], *args: object) -> ReadJob:
        job = ReadJob(self._turns)
        threading.Thread(target=job.run, args=(read, args), name=self._name, daemon=True).start()
        return job


class ReadJob:
    """One read on its own thread: `future` holds its result; its turn is given back when it ends or when it is
    abandoned, whichever comes first."""

    def __init__(self, turns: threading.Semaphore):
        self.future: Future = Future()
        self._turns = turns
        self._lock = threading.Lock()
        self._holds_turn = False
        self._abandoned = False

    def run(self, read: Callable[..., object], args: tuple) -> None:
        self._turns.acquire()
        with self._lock:
            if self._abandoned:  # given up on while it waited for its turn
                self._turns.release()
                return
            self._holds_turn = True
        try:
            self.future.set_result(read(*args))
        except BaseException as exc:  # the read catches what it expects: whatever else, its waiter sees it
            self.future.set_exception(exc)
        finally:
            self._give_back_turn()

    def abandon(self) -> None:
        """Stop waiting for this read: the next one may start even if this one never ends."""
        with self._lock:
            self._abandoned = True
        self._give_back_turn()

    def _give_back_turn(self) -> None:
        with self._lock:
            holds, self._holds_turn = self._holds_turn, False
        if holds:
            self._turns.release()
