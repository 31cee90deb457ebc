"""Beam search on top of the engine: every beam is a request; a step forks the chosen beams (sharing their KV
blocks, copy-on-write) and aborts the others (releasing theirs).

It follows transformers' `generate(num_beams=k, do_sample=False)` with its default `early_stopping=False`: each
step ranks the top max(2, 1 + #EOS ids) * k continuations of all beams by cumulative log-probability; those of the
best k that end in EOS (or reach max_tokens) become finished hypotheses scored cumulative_logprob /
generated_len ** length_penalty, the best k of the others continue; the search stops at max_tokens, or once k
hypotheses are finished and the best live beam, scored at its current length, cannot beat the worst of them.
With ignore_eos=True, EOS is an ordinary token (transformers has no such switch: compare with a model without
EOS). Prompts run concurrently; each one's beams step together."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.prompts import PromptType, is_single_prompt, parse_prompt
from kvserve.kv.kv_cache_manager import blocks_needed
from kvserve.sampling_params import BeamSearchParams, SamplingParams

MAX_LOGPROBS = 20  # SamplingParams.logprobs' limit: the per-beam candidates one step can report


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens, the EOS that ended it included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what hypotheses are ranked by
    finish_reason: str  # "stop" (EOS) or "length"
    text: str | None = None


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # beam_width hypotheses, best first


@dataclass
class _Beam:
    request_id: str
    token_ids: list[int]
    cumulative_logprob: float


@dataclass
class _Search:
    """One prompt's beams and finished hypotheses; `step` runs once all its beams have a new token's logprobs."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    num_candidates: int
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False

    def step(self, alternatives: dict[str, dict[int, float]]) -> list[tuple[_Beam, int, float]]:
        """Rank the continuations and update the hypotheses; returns (parent beam, token, cumulative logprob)
        of the beams that go on (none once the search is done)."""
        k, length_penalty = self.params.beam_width, self.params.length_penalty
        gen_len = len(self.beams[0].token_ids) + 1
        candidates = sorted(
            ((beam.cumulative_logprob + logprob, beam, token) for beam in self.beams
             for token, logprob in sorted(alternatives[beam.request_id].items())),
            key=lambda c: -c[0],
        )[: self.num_candidates]
        last_step = gen_len == self.params.max_tokens
        for cum, beam, token in candidates[:k]:  # only the best k may finish, as in transformers
            if last_step or token in self.eos_token_ids:
                reason = "stop" if token in self.eos_token_ids else "length"
                self.finished.append(
                    BeamSearchSequence(beam.token_ids + [token], cum, cum / gen_len**length_penalty, reason))
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:k]
        going_on = [(beam, token, cum) for cum, beam, token in candidates if token not in self.eos_token_ids][:k]
        # transformers' early_stopping=False heuristic: the best live beam, scored at its current length
        best_live_score = going_on[0][2] / gen_len**length_penalty if going_on else float("-inf")
        self.done = last_step or (len(self.finished) == k and best_live_score <= self.finished[-1].score)
        return [] if self.done else going_on


def beam_search(engine: LLMEngine, prompts: PromptType | Seq[PromptType],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for every prompt on an idle engine; outputs in prompt order, each with beam_width
    hypotheses. Every prompt is checked before any runs: a bad one raises ValueError naming it."""
    if engine.has_unfinished_requests():
        raise RuntimeError("beam search needs an idle engine: finish or abort its running requests first")
    prompt_list = [prompts] if is_single_prompt(prompts) else list(prompts)
    token_lists = [_token_ids(engine, i, prompt) for i, prompt in enumerate(prompt_list)]
    eos = frozenset() if params.ignore_eos else engine.eos_token_ids
    num_candidates = max(2, 1 + len(eos)) * params.beam_width
    _check_fits(engine, token_lists, params, num_candidates)
    sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True, logprobs=num_candidates)
    ids = (f"beam-{i}" for i in itertools.count())
    searches: list[_Search] = []
    try:
        for i, (prompt, token_ids) in enumerate(zip(prompt_list, token_lists)):
            request_id = next(ids)
            salt = parse_prompt(prompt).cache_salt
            try:
                engine.add_request(request_id, {"prompt_token_ids": token_ids, "cache_salt": salt}, sampling)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            searches.append(_Search(params, eos, num_candidates, [_Beam(request_id, [], 0.0)]))
        if engine.speculator is not None:  # beams step one token at a time: no drafts meanwhile
            engine.speculator.paused = True
        _run(engine, searches, ids)
    finally:
        if engine.speculator is not None:
            engine.speculator.paused = False
        for search in searches:
            for beam in search.beams:
                engine.abort_request(beam.request_id)
    return [BeamSearchOutput(token_ids, [_with_text(engine, h) for h in search.finished])
            for token_ids, search in zip(token_lists, searches)]


def _run(engine: LLMEngine, searches: list[_Search], ids) -> None:
    """Step the engine; whenever all beams of a search have their next logprobs, let it choose, fork, drop."""
    pending: dict[str, dict[int, float]] = {}
    while not all(s.done for s in searches):
        if not engine.has_unfinished_requests():
            raise RuntimeError("the engine ran out of requests before beam search finished")
        for output in engine.step():
            if output.request_id in pending:
                raise RuntimeError(f"beam {output.request_id} ran ahead of its siblings (was one preempted?)")
            pending[output.request_id] = output.outputs[0].logprobs[-1]
        for search in searches:
            if search.done or any(b.request_id not in pending for b in search.beams):
                continue
            going_on = search.step({b.request_id: pending.pop(b.request_id) for b in search.beams})
            search.beams = _fork_and_drop(engine, search.beams, going_on, ids)


def _fork_and_drop(engine: LLMEngine, parents: list[_Beam], going_on: list[tuple[_Beam, int, float]],
                   ids) -> list[_Beam]:
    """The chosen continuations forked, the old beams dropped: first those with no continuation, then each parent
    right after its own children are forked (a child shares its parent's blocks only if forked before the parent
    is dropped). So at most beam_width + 1 beams of a search are alive at once, which a hybrid model's state slots
    (one per beam) must hold."""
    children: dict[str, list[int]] = {}  # each parent's continuations, by their place in going_on
    for place, (parent, _, _) in enumerate(going_on):
        children.setdefault(parent.request_id, []).append(place)
    for beam in parents:
        if beam.request_id not in children:
            engine.abort_request(beam.request_id)
    forks: list[_Beam | None] = [None] * len(going_on)  # in going_on's order, best first
    for beam in parents:
        for place in children.get(beam.request_id, ()):
            _, token, cumulative_logprob = going_on[place]
            child_id = next(ids)
            engine.fork_request(beam.request_id, child_id, last_token_id=token)
            forks[place] = _Beam(child_id, beam.token_ids + [token], cumulative_logprob)
        if beam.request_id in children:
            engine.abort_request(beam.request_id)
    return forks


def _token_ids(engine: LLMEngine, index: int, prompt: PromptType) -> list[int]:
    try:
        parsed = parse_prompt(prompt)
        return list(parsed.token_ids) if parsed.token_ids is not None else engine.encode(parsed.text)
    except ValueError as exc:
        raise ValueError(f"prompt {index}: {exc}") from exc


def _check_fits(engine: LLMEngine, token_lists: list[list[int]], params: BeamSearchParams, num_candidates: int) -> None:
    """All beams must run every step without preemption, or they would fall out of step."""
    if num_candidates > MAX_LOGPROBS:
        raise ValueError(f"beam_width={params.beam_width} needs the top {num_candidates} log-probs per beam and "
                         f"step; at most {MAX_LOGPROBS} are available (beam_width <= {MAX_LOGPROBS // 2} "
                         f"with ignore_eos or one EOS id)")
    num_beams = len(token_lists) * params.beam_width
    if num_beams > engine.config.max_num_batched_tokens:
        raise ValueError(f"{len(token_lists)} prompts x beam_width={params.beam_width} beams exceed "
                         f"max_num_batched_tokens={engine.config.max_num_batched_tokens}; pass fewer prompts")
    slots = engine.kv.state.num_slots if engine.kv.state is not None else None
    if slots is not None and num_beams + 1 > slots:  # a hybrid model: each beam holds a state slot
        raise ValueError(f"{len(token_lists)} prompts x beam_width={params.beam_width} beams need {num_beams + 1} "
                         f"state slots while beams are forked; the cache has {slots} (one per max_num_seqs): "
                         f"raise max_num_seqs to {num_beams + 1} or pass fewer prompts")
    block_size, num_blocks = engine.kv.block_size, engine.kv.pool.num_blocks
    worst = sum(params.beam_width * blocks_needed(len(t) + params.max_tokens, block_size) for t in token_lists)
    if worst > num_blocks:
        raise ValueError(f"beam search over {len(token_lists)} prompts may need {worst} KV blocks with "
                         f"beam_width={params.beam_width}, max_tokens={params.max_tokens}; the cache has "
                         f"{num_blocks}: pass fewer prompts at a time or raise kv_cache_memory")


def _with_text(engine: LLMEngine, hypothesis: BeamSearchSequence) -> BeamSearchSequence:
    if engine.tokenizer is not None:
        hypothesis.text = engine.tokenizer.decode(hypothesis.token_ids, skip_special_tokens=True)
    return hypothesis
