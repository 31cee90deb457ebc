"""One token stream being generated: its tokens, how many have K/V in the cache, and why it stopped."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.engine.detokenizer import Detokenizer
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.structured import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str  # unique per sequence: the user's id, plus "#i" for the i-th of n samples
    index: int  # which of the request's n outputs this is
    token_ids: list[int]  # prompt then output
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    detokenizer: Detokenizer
    cache_salt: str | None = None
    seed: int | None = None  # params.seed + index: what keys this sequence's random draws (engine/sampler.py)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    # prompt_logprobs: one dict per scored prompt token, or [n, vocab] tensors for the whole vocabulary (-1)
    prompt_logprobs: list[dict[int, float] | torch.Tensor] = field(default_factory=list)
    num_scored_prompt_tokens: int = 0  # prompt tokens after the first whose log-probabilities were recorded
    cumulative_logprob: float = 0.0
    forked: bool = False  # True once the n-1 siblings of sample 0 exist
    num_preemptions: int = 0
    arrival: int = 0  # when its request reached the scheduler (0, 1, 2, ...); a request's samples share it
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for it, and of those, accepted
    num_accepted_tokens: int = 0
    grammar: GrammarMatcher | None = None  # structured outputs: what the sampler lets this sequence take next

    @property
    def rank(self) -> tuple[int, int]:
        """Scheduling order, lowest first: every request's first sample before any request's second, and so on;
        among equals the request that came first."""
        return self.index, self.arrival

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def record_prompt_logprobs(self, logprobs: torch.Tensor) -> None:
        """Log-softmax rows [n, vocab] predicting the next `n` unscored prompt tokens."""
        k = self.params.prompt_logprobs
        first = self.num_scored_prompt_tokens + 1
        self.num_scored_prompt_tokens += len(logprobs)
        if k == -1:
            self.prompt_logprobs.append(logprobs)
            return
        actual = torch.tensor(self.token_ids[first : first + len(logprobs)])
        chosen = logprobs.gather(1, actual[:, None]).squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        for token_id, value, ids, values in zip(actual.tolist(), chosen, top_ids.tolist(), top_values.tolist()):
            entry = dict(zip(ids, values))
            entry[token_id] = value
            self.prompt_logprobs.append(entry)

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None) -> None:
        """Add a sampled token and decide whether the sequence is done."""
        is_eos = token_id in self.eos_token_ids
        if self.grammar is not None and not is_eos:  # the mask allowed an end token only where the grammar ends
            self.grammar.accept(token_id)
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.logprobs = (self.logprobs or []) + [top_logprobs]
        self.detokenizer.update(self.output_token_ids)
        if is_eos and (not self.params.ignore_eos or self.grammar is not None):
            self.finish("stop", token_id)
        elif token_id in self.params.stop_token_ids:
            self.finish("stop", token_id)
        elif self.detokenizer.stop_hit is not None:
            self.finish("stop", self.detokenizer.stop_hit)
        elif self.grammar is not None and self.grammar.is_finished:
            self.finish("stop")
        elif self.num_output_tokens >= self.max_tokens:
            self.finish("length")

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
