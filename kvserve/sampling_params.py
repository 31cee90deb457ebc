"""What the user asks of one request's decoding (follows vLLM's names)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling and stopping rules for one request. temperature=0 means greedy."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt token; -1: the whole vocabulary as one tensor
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        checks = [
            (_is_int(self.n) and self.n >= 1, f"n must be an integer of at least 1, got {self.n!r}"),
            (self.max_tokens is None or _is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
             f"top_k must be an integer, 0 or -1 (off) or positive, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= 20,
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or _is_int(self.prompt_logprobs) and -1 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be an integer in [0, 20], or -1 for the whole vocabulary, got "
             f"{self.prompt_logprobs!r}"),
            (self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty strings, got {self.stop}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_int(value: object) -> bool:
    # a float here would only fail later, inside a running step (range, topk, manual_seed)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class BeamSearchParams:
    """Beam search: keep the `beam_width` best sequences by cumulative log-probability."""

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
