"""Logits -> next tokens for a batch of sequences, each with its own parameters and random generator.

A seeded sequence draws its output token i from a generator keyed by (seed, i) alone, so its text does not depend on
how many draws came before: not on the batch, preemption, or speculative decoding (whose verification rows draw for
every draft token, accepted or not, and whose drafts are dropped when blocks run short). Unseeded sequences share
the engine's generator.

Each chosen token's log-probability (and the top ones a sequence asks for) comes from log_softmax over a few rows at a
time: a large vocabulary's [N, V] log-probabilities at once (Gemma 3's 262,144 over 32 rows: 33.5 MB) exceed the
size glibc serves from the kept heap (engine/heap.py), so every step would page a fresh block in, 4 KiB at a time."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.sequence import Sequence
from kvserve.engine.structured import grammar_bitmask, mask_disallowed_

LOGPROB_ROWS_BYTES = 16 * 2**20  # log-probabilities computed at a time: well under the heap's 32 MiB (module doc)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the model's raw distribution
    top_logprobs: list[dict[int, float] | None]  # when the sequence asked for logprobs


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> SampleResult:
    """logits: [N, V] float32, row i belongs to seqs[i]."""
    processed = _apply_penalties(_apply_grammars(logits, seqs), seqs)
    # max's indices are argmax's (the first largest), and PyTorch finds them faster on a CPU
    token_ids = processed.max(dim=-1).indices
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = _processed_probs(processed[rows], [seqs[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            token_ids[i] = _draw(probs[j], draw_generator(seqs[i], default_generator))
    chosen, top = [], []
    step = max(1, LOGPROB_ROWS_BYTES // (logits.shape[1] * logits.element_size()))
    for start in range(0, len(seqs), step):  # under the raw distribution, a few rows at a time (module doc)
        raw_logprobs = torch.log_softmax(logits[start : start + step], dim=-1)
        ids = token_ids[start : start + step]
        chosen += raw_logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
        top += [_top_logprobs(row, int(i), s) for row, i, s in zip(raw_logprobs, ids, seqs[start : start + step])]
    return SampleResult(token_ids=token_ids.tolist(), logprobs=chosen, top_logprobs=top)


def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Constrained rows (structured outputs) keep only the tokens their grammar allows next, in a copy; a batch
    without one is returned as it is. Only those rows are read and masked (from the packed bitmask), and they are
    written back into one copy of the batch's logits."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return logits
    bitmask = grammar_bitmask([seqs[i].grammar for i in rows])
    if len(rows) == len(seqs):
        return mask_disallowed_(logits.clone(), bitmask)
    index = torch.tensor(rows)
    return logits.index_copy(0, index, mask_disallowed_(logits.index_select(0, index), bitmask))


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.params.needs_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        p = seqs[i].params
        if p.repetition_penalty != 1:  # HF/vLLM: over prompt and output, shrink toward zero
            seen = torch.tensor(sorted(set(seqs[i].token_ids)), dtype=torch.long)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:  # OpenAI: over generated tokens only
            counts = torch.bincount(torch.tensor(seqs[i].output_token_ids, dtype=torch.long), minlength=vocab)
            logits[i] -= p.frequency_penalty * counts[:vocab] + p.presence_penalty * (counts[:vocab] > 0)
    return logits


def _processed_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering, row by row parameters, one batched pass each."""
    temperature = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype)[:, None]
    logits = logits / temperature
    top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else logits.shape[1] for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
    if bool((top_k < logits.shape[1]).any() or (top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1])[None, :]
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (ranks >= top_k[:, None]) | (mass_before >= top_p[:, None])
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([s.params.min_p for s in seqs], dtype=probs.dtype)[:, None]
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def draw_generator(seq: Sequence, default_generator: torch.Generator) -> torch.Generator:
    """The generator of `seq`'s next draw: for a seeded sequence, one seeded by its seed and the position of the token
    being drawn (its output tokens so far, a verification row's drafts included); else the shared default."""
    if seq.seed is None:
        return default_generator
    return torch.Generator().manual_seed(_mix64(_mix64(seq.seed) + len(seq.output_token_ids)))


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a 64-bit hash whose nearby inputs give unrelated outputs."""
    x &= 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return x ^ (x >> 31)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    # argmax(p / E) with E ~ Exp(1) picks index i with probability p_i: one draw per row from its own generator
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).max(dim=-1).indices)


def _top_logprobs(row: torch.Tensor, token_id: int, seq: Sequence) -> dict[int, float] | None:
    k = seq.params.logprobs
    if k is None:
        return None
    top = {int(t): float(v) for v, t in zip(*row.topk(k))} if k else {}
    top[token_id] = float(row[token_id])
    return top
