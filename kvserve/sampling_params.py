"""What the user asks of one request's decoding (follows vLLM's names)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Bounds on what one request may ask for, so its per-token cost stays small (every stop string is searched,
# and every stop token id compared, after every token) and every value fits the sampler's tensors.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: dividing logits by less overflows float32 into inf / NaN
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's name and fields): a JSON schema (a dict or its JSON text), any
    JSON object, a regular expression, one of a list of strings, or a Lark grammar (llguidance's dialect)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        for name in ("regex", "grammar"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or its JSON text")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None) \
            if not self.json_object else "json_object"


@dataclass
class SamplingParams:
    """Sampling and stopping rules for one request. temperature=0 (anything below 1e-5) means greedy."""

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
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (engine/structured.py)

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
            (_is_finite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (_is_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1) and self.top_k <= INT64_MAX,
             f"top_k must be an integer, 0 or -1 (off) or positive below 2**63, got {self.top_k!r}"),
            (_is_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (_is_finite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
             f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}"),
            (_is_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_is_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= 20,
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (self.prompt_logprobs is None or _is_int(self.prompt_logprobs) and -1 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be an integer in [0, 20], or -1 for the whole vocabulary, got "
             f"{self.prompt_logprobs!r}"),
            (self.seed is None or _is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX,
             f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        self._check_stops()

    def _check_stops(self) -> None:
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if (longest := max(map(len, self.stop), default=0)) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
        if not all(map(is_text, self.stop)):
            raise ValueError("stop strings must be valid Unicode text (no lone surrogates)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if not all(map(_is_int, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids[:8]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_int(value: object) -> bool:
    # a float here would only fail later, inside a running step (range, topk, manual_seed)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_text(value: str) -> bool:
    """True if `value` is encodable as UTF-8: JSON's \\ud800 escapes can give Python strings that are not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
