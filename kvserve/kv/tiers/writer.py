"""The disk tier's writer thread: the step thread queues a block's bytes and never waits (a block the writer has no
room for is refused, for the caller to hand again later); one daemon thread writes them, in order, and ends when
idle. A block queued or being written is still found (`queued`): the writer may be behind the step thread by seconds
when both want the GIL, and a returning request must not miss it."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvserve.kv.block_hash import BlockHash
from kvserve.kv.tiers.record import BLOCK, BlockRecord, RecordKind

MAX_PENDING_BYTES = 256 * 2**20  # blocks copied for the writer and not yet written; more are skipped, not waited for
WRITER_IDLE_S = 1.0  # the writer thread ends after this long without work (a later block starts a new one)


class RecordWriter:
    """Queued records, written one at a time by `write` on a thread of its own; `on_skip` counts a refused one."""

    def __init__(self, write: Callable[[BlockRecord], None], on_skip: Callable[[], None]):
        self._write = write
        self._on_skip = on_skip
        self.cond = threading.Condition()  # guards everything below
        self.queue: deque[BlockRecord] = deque()
        self.pending: dict[tuple[str, BlockHash], BlockRecord] = {}  # queued or being written, by kind and key
        self.pending_bytes = 0
        self.thread: threading.Thread | None = None
        self.closing = False  # the interpreter is exiting: the thread ends after its record (stop)

    def submit(self, record: BlockRecord) -> bool:
        """Queue a block for writing; never waits. False if it was skipped because the writer is MAX_PENDING_BYTES
        behind; True if queued, queued already, or the writer is closing."""
        with self.cond:
            if self.closing or record.name in self.pending:
                return True
            if self.pending_bytes + record.nbytes > MAX_PENDING_BYTES:
                self._on_skip()
                return False
            self.queue.append(record)
            self.pending[record.name] = record
            self.pending_bytes += record.nbytes
            if self.thread is None:
                thread = threading.Thread(target=self._write_queued, name="kvserve-disk-writer", daemon=True)
                try:
                    thread.start()
                    self.thread = thread
                except RuntimeError:  # an exiting interpreter starts no threads (3.12+): flush writes on its own
                    pass
            self.cond.notify_all()
            return True

    def queued(self, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
               kind: RecordKind = BLOCK) -> BlockRecord | None:
        """The record of `kind` queued (or being written) for `key`, if it is the one the request's chain asks for."""
        with self.cond:
            record = self.pending.get((kind.name, key))
        if record is None or record.parent != parent or record.token_ids != tuple(token_ids):
            return None
        return record

    def wait_for_room(self, num_bytes: int, timeout_s: float) -> bool:
        """Wait until the writer is less than half of MAX_PENDING_BYTES behind with `num_bytes` more; False if
        `timeout_s` passed first."""
        with self.cond:
            return self.cond.wait_for(lambda: self.pending_bytes + num_bytes <= MAX_PENDING_BYTES // 2, timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is written (or skipped); False if `timeout_s` passed first. With no writer
        thread (none could start: the interpreter is exiting) the queue is written here."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.thread is None and (deadline is None or time.monotonic() < deadline) and self._write_next():
            pass
        with self.cond:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self.cond.wait_for(lambda: not self.pending, left)

    def stop(self, timeout_s: float) -> None:
        """End the writer thread (after the record it is writing) and wait up to `timeout_s` for it: what is still
        queued stays unwritten. At exit, after the flush, so that no daemon thread is still running library code while
        the interpreter finalizes, which can abort the process."""
        with self.cond:
            self.closing = True
            thread = self.thread
            self.cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _write_queued(self) -> None:
        while True:
            with self.cond:
                if not self.queue and not self.closing:
                    self.cond.wait(WRITER_IDLE_S)
                if not self.queue or self.closing:
                    self.thread = None
                    self.cond.notify_all()
                    return
            self._write_next()

    def _write_next(self) -> bool:
        """Write the oldest queued block; False if none was queued."""
        with self.cond:
            if not self.queue:
                return False
            record = self.queue.popleft()
        try:
            self._write(record)
        finally:
            with self.cond:
                del self.pending[record.name]
                self.pending_bytes -= record.nbytes
                self.cond.notify_all()
        return True
