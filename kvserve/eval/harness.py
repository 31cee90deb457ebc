"""Runs every setting's engine over the same tokens and collects quality against the reference (the first).

Each setting is its own engine (own paged pool), so every number comes through the serving code path: block
tables, chunked prefill, the cache's stored format. Scoring uses the engine's prompt log-probabilities."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.eval.metrics import QualityTotals
from kvserve.eval.passkey import ANSWER_TOKENS, PasskeyTrial, passed
from kvserve.eval.windows import Window
from kvserve.sampling_params import SamplingParams

SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1)
STREAM_REQUEST_ID = "eval-stream"

Advance = Callable[[], None]  # called once per unit of work done, for the progress bar


@dataclass
class StreamTotals:
    """A streamed text's totals plus the tested setting's own perplexity per segment of the text."""

    totals: QualityTotals = field(default_factory=QualityTotals)
    segment_nll: list[float] = field(default_factory=list)
    segment_tokens: list[int] = field(default_factory=list)

    def add_nll(self, positions: torch.Tensor, nll: torch.Tensor, segment_tokens: int) -> None:
        for segment, value in zip((positions // segment_tokens).tolist(), nll.tolist()):
            while len(self.segment_nll) <= segment:
                self.segment_nll.append(0.0)
                self.segment_tokens.append(0)
            self.segment_nll[segment] += value
            self.segment_tokens[segment] += 1


def score_prompt(llm, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-probabilities of each prompt token given the ones before it (row 0 is NaN)."""
    return llm.generate(token_ids, SCORE)[0].prompt_logprobs


def score_windows(llms: list, token_ids: list[int], windows: list[Window], advance: Advance) -> list[QualityTotals]:
    """Every window through every engine; the first engine's distributions are the reference."""
    totals = [QualityTotals() for _ in llms]
    for window in windows:
        ids = token_ids[window.start : window.end]
        targets = torch.tensor(ids[len(ids) - window.num_scored :])
        reference = None
        for llm, total in zip(llms, totals):
            rows = score_prompt(llm, ids)[len(ids) - window.num_scored :]
            reference = rows if reference is None else reference
            total.add(reference, rows, targets)
            advance()
    return totals


def score_stream(llms: list, token_ids: list[int], with_reference: bool, segment_tokens: int,
                 advance: Advance) -> list[StreamTotals]:
    """The whole text as one sequence per engine, prefilled `max_num_batched_tokens` tokens per step, so the cache
    (and any eviction policy) sees the whole history. Engines step in lockstep; without a reference (the text is
    longer than it can hold), only each setting's own perplexity is kept."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=-1)
    engines = [llm.engine for llm in llms]
    for engine in engines:
        engine.add_request(STREAM_REQUEST_ID, token_ids, params)
    results = [StreamTotals() for _ in llms]
    scored = 0
    try:
        while scored < len(token_ids) - 1:
            rows = []
            for engine in engines:
                engine.step()
                rows.append(engine.take_prompt_logprobs(STREAM_REQUEST_ID))
            if len({len(r) for r in rows}) != 1:
                raise RuntimeError("settings scored different numbers of tokens in one step")
            positions = torch.arange(scored + 1, scored + 1 + len(rows[0]))
            targets = torch.tensor(token_ids[scored + 1 : scored + 1 + len(rows[0])])
            for result, row in zip(results, rows):
                if with_reference:
                    result.totals.add(rows[0], row, targets)
                else:
                    result.totals.add(row, row, targets)
                result.add_nll(positions, -row.gather(1, targets[:, None]).squeeze(1), segment_tokens)
            scored += len(rows[0])
            advance()
    finally:
        for engine in engines:
            engine.abort_request(STREAM_REQUEST_ID)
    return results


def passkey_accuracy(llm, trials: list[PasskeyTrial]) -> float:
    """Share of trials whose greedy answer contains the key (all trials batched in one call)."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
    outputs = llm.generate([t.token_ids for t in trials], params)
    return sum(passed(t, o.outputs[0].text) for t, o in zip(trials, outputs)) / len(trials)
