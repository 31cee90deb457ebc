"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    # LLM.chat(..., tools=...): the calls parsed out of `text`, {"id", "name", "arguments" (JSON text)} each
    tool_calls: list[dict[str, str]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found cached (pool and disk tier)
    num_disk_cached_tokens: int = 0  # of those, the ones read from the disk tier (--kv-disk-cache)
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified for it (all n samples) ...
    num_accepted_tokens: int = 0  # ... and of those, accepted
    metrics: RequestMetrics | None = None
    # per prompt token (None for the first): {token id: logprob} with the top-k and the actual token; or, when
    # SamplingParams(prompt_logprobs=-1), one [prompt_len, vocab] float32 tensor whose first row is NaN
    prompt_logprobs: list[dict[int, float] | None] | torch.Tensor | None = None
    error: str | None = field(default=None)  # set when the request failed inside a step (finish_reason "error")
