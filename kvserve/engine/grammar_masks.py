"""Constrained sequences' next-token masks computed ahead: started when a step is scheduled, on one worker thread
that hands all the step's matchers to llguidance's own threads at once (Rust, without the GIL), so the masks are
computed while the model's forward runs, and taken at sampling. The next token's mask depends only on the tokens a
sequence has already taken, and none is taken between the schedule and the sampling; a matcher that has taken one
since (or whose batch failed) computes its mask at sampling as before. Measured in docs/benchmarks.md, "Constrained
requests mixed in"."""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import torch

if TYPE_CHECKING:
    from kvserve.engine.structured import GrammarMatcher

logger = logging.getLogger("kvserve")
MAX_MASK_THREADS = 4  # llguidance's threads for one step's masks (a mask takes tens of microseconds)


def default_mask_threads() -> int:
    """The cores torch's threads leave free, at least one and at most MAX_MASK_THREADS: the masks are computed while
    the forward runs, and threads beyond the free cores would only take turns with the forward's."""
    return max(1, min(MAX_MASK_THREADS, (os.cpu_count() or 1) - torch.get_num_threads()))


class MaskWorker:
    """One engine's: the thread that starts a step's masks, and llguidance's threads that compute them."""

    def __init__(self, num_threads: int | None = None):
        self._executor = llguidance.LLExecutor(num_threads or default_mask_threads())
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar-masks")

    def start(self, matchers: list[GrammarMatcher]) -> MasksAhead:
        """Begin computing each matcher's next mask; use the result as a context manager around the step, so that
        nothing outlives it (its exit waits for the worker and detaches the masks from their matchers)."""
        bitmask = torch.empty(len(matchers), matchers[0].num_words, dtype=torch.int32)
        return MasksAhead(matchers, bitmask, self._thread.submit(self.fill, matchers, bitmask))

    def fill(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` [len(matchers), num_words] int32: matcher i's next mask, computed in parallel."""
        rows = [(matcher.llmatcher, i) for i, matcher in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))


class MasksAhead:
    """One step's masks, being computed: each matcher holds its row, valid while it has taken no token since."""

    def __init__(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, done: Future):
        self._matchers, self._bitmask, self._done = matchers, bitmask, done
        self._failure_logged = False
        for row, matcher in enumerate(matchers):
            matcher.ahead = (self, row, matcher.num_accepted)

    def row(self, index: int) -> torch.Tensor | None:
        """Row `index` once computed (waiting for it); None if the worker failed (the matcher computes its own)."""
        if not self.wait():
            return None
        return self._bitmask[index]

    def wait(self) -> bool:
        """Wait for the worker; False if it raised (logged once, and the matchers compute their masks alone)."""
        try:
            self._done.result()
        except Exception as exc:
            if not self._failure_logged:
                self._failure_logged = True
                logger.warning(f"grammar masks computed ahead failed ({type(exc).__name__}: {exc}); computing "
                               "them at sampling")
            return False
        return True

    def close(self) -> None:
        self.wait()
        for matcher in self._matchers:
            if matcher.ahead is not None and matcher.ahead[0] is self:
                matcher.ahead = None

    def __enter__(self) -> MasksAhead:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
