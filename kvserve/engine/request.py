"""A user's request: its prompt, parameters, timing, and the n sequences sampled for it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.sequence import Sequence
from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those the disk tier brought into the pool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    error: str | None = None  # why it failed inside a step (its sequences finished with "error")
    grammar: Any = None  # structured outputs: the compiled constraint each sequence gets a matcher of

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)

    def to_output(self) -> RequestOutput:
        finished = self.finished
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.stable_text(seq.is_finished),
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(self.sequences, key=lambda s: s.index)
        ]
        return RequestOutput(
            prompt_logprobs=self._prompt_logprobs(),
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            num_disk_cached_tokens=self.num_disk_cached_tokens,
            num_draft_tokens=sum(s.num_draft_tokens for s in self.sequences),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in self.sequences),
            metrics=self.metrics,
            error=self.error,
        )

    def failed_output(self) -> RequestOutput:
        """The output of a request whose to_output raised: its tokens, no text or logprobs, every choice "error"."""
        outputs = [CompletionOutput(index=seq.index, text="", token_ids=list(seq.output_token_ids),
                                    finish_reason="error")
                   for seq in sorted(self.sequences, key=lambda s: s.index)]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, num_cached_tokens=self.num_cached_tokens,
                             num_disk_cached_tokens=self.num_disk_cached_tokens, metrics=self.metrics, error=self.error)

    def _prompt_logprobs(self) -> list[dict[int, float] | None] | torch.Tensor | None:
        if self.params.prompt_logprobs is None or not self.sequences:
            return None
        scored = self.sequences[0].prompt_logprobs  # the prompt is computed once, by the first sequence
        if self.params.prompt_logprobs != -1:
            return [None, *scored]
        vocab = scored[0].shape[1] if scored else 0
        return torch.cat([torch.full((1, vocab), float("nan")), *scored])
