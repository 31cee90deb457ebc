"""Hold a served engine between steps, so a test can look at requests that hold KV blocks."""
from __future__ import annotations

import threading
import time


class StepGate:
    """Replaces `engine.step`: the engine takes only the steps the test allows. While held, the engine thread
    still runs its loop and answers commands (the dashboard's snapshots, aborts) but computes nothing."""

    def __init__(self, engine):
        self._step = engine.step
        self._allowed: int | None = None  # None: no limit
        self._taken = 0
        self._lock = threading.Lock()
        self._stepping = threading.Lock()  # held while a step is decided and run
        engine.step = self.step

    def step(self):
        with self._stepping:
            with self._lock:
                go = self._allowed is None or self._allowed > 0
                if go and self._allowed is not None:
                    self._allowed -= 1
            if go:
                outputs = self._step()
                with self._lock:
                    self._taken += 1
                return outputs
        time.sleep(0.002)
        return []

    def hold(self) -> None:
        """Take no step from now on (after the one running, if any)."""
        with self._lock:
            self._allowed = 0

    def release(self) -> None:
        with self._lock:
            self._allowed = None

    def run(self, num_steps: int, timeout_s: float = 30.0) -> None:
        """Let exactly `num_steps` more steps run and wait for them (the engine must have work to do)."""
        self.hold()
        with self._stepping:  # a step already running finishes first and does not count
            pass
        with self._lock:
            target, self._allowed = self._taken + num_steps, num_steps
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._taken >= target:
                    return
            assert time.monotonic() < deadline, f"the engine did not take {num_steps} steps in {timeout_s} s"
            time.sleep(0.002)
