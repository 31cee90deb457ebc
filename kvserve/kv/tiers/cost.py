"""Read or recompute: whether reading a prefix's records from disk is faster than prefilling the tokens they save,
at the read and prefill rates measured so far (exponentially averaged; until both are measured, reading is tried)."""
from __future__ import annotations

import logging

logger = logging.getLogger("kvserve")


class ReadCost:
    """The disk tier's measured read and prefill rates, and the choice between reading and recomputing."""

    def __init__(self):
        self.num_recomputed_tokens = 0  # tokens on disk the engine chose to prefill instead: faster than reading
        # measured rates (None until measured: reading is tried first), exponentially averaged
        self.read_bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self._logged_recompute = False

    def worth_reading(self, num_bytes: int, num_tokens: int) -> bool:
        """Whether reading `num_bytes` of records is faster than prefilling the `num_tokens` they save, at the rates
        measured so far; when it is not, the tokens are counted and the first time logged."""
        if self.read_bytes_per_s is None or self.prefill_tokens_per_s is None:
            return True
        read_s = num_bytes / self.read_bytes_per_s
        prefill_s = num_tokens / self.prefill_tokens_per_s
        if read_s <= prefill_s:
            return True
        self.num_recomputed_tokens += num_tokens
        if not self._logged_recompute:
            self._logged_recompute = True
            logger.info(f"KV disk cache: prefilling {num_tokens:,} tokens ({prefill_s:.3f} s at "
                        f"{self.prefill_tokens_per_s:,.0f} tokens/s) rather than reading them ({read_s:.3f} s at "
                        f"{self.read_bytes_per_s / 1e6:,.0f} MB/s); counted in kvserve:kv_disk_cache_recomputed_tokens")
        return False

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled `num_tokens` took `seconds` (the engine reports it: the rate loading competes with)."""
        self.prefill_tokens_per_s = _averaged(self.prefill_tokens_per_s, num_tokens / seconds)

    def note_read(self, num_bytes: int, seconds: float) -> None:
        """`num_bytes` of records came from disk in `seconds` (none taken from the writer's queue: a memory copy says
        nothing of how fast the disk reads)."""
        self.read_bytes_per_s = _averaged(self.read_bytes_per_s, num_bytes / max(seconds, 1e-6))


def _averaged(average: float | None, value: float) -> float:
    """An exponential average that follows a rate over the last ten or so measurements."""
    return value if average is None else 0.9 * average + 0.1 * value
