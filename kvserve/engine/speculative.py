"""Speculative decoding without a draft model: propose the next tokens from text the request (or recent requests)
already hold, verify them all in one forward pass, and keep the longest prefix the model agrees with.

Proposing, at schedule time (`Speculator.propose`):
- "ngram" (prompt lookup, vLLM's `ngram`, llama.cpp's lookup decoding): the last n tokens, n from
  prompt_lookup_max down to prompt_lookup_min, looked up in the request's own prompt and output; the tokens that
  followed their latest earlier occurrence are the draft.
- "suffix" (after suffix decoding): the longest suffix of the request, up to suffix_decoding_max_tree_depth tokens,
  that occurs earlier in the request or in one of the last suffix_decoding_max_cached_requests requests' outputs
  (which repeat across templated and agentic traffic); it proposes up to suffix_decoding_max_spec_factor tokens per
  matched token. An n-gram index per depth stands in for the suffix tree (same matches, no frequency pruning).
The scheduler gives a drafted sequence 1 + k tokens: its last token and the draft, in slots of its own blocks.

Verifying, after the forward pass (`sample_drafted`): row j of a drafted sequence's logits is the distribution of
the token after the last token and draft tokens 1..j. Every row is sampled exactly as a plain decode step samples
(penalties see the drafts before it); the draft is accepted up to the first row whose sample differs from it, and
that row's sample ends the step. Greedy, the tokens are exactly plain decoding's. Sampling: a proposal that is one
fixed token is a draft distribution q that is one-hot, for which the rejection sampler (Leviathan et al., Chen et
al.) accepts d with probability min(1, p(d)/q(d)) = p(d) and on rejection samples from max(0, p - q) renormalized
= p without d; "sample t ~ p, accept while t == d" is that sampler, so every output token has the target's
distribution. The engine then rolls the K/V back: the sequence's computed tokens stop after the accepted ones, the
blocks only rejected tokens were written to go back to the pool (`KVCacheManager.trim`), slots of rejected tokens
in a kept block are written again by later tokens, and only computed (accepted) tokens are ever hashed into the
prefix index."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kvserve.config import SpeculativeConfig
from kvserve.engine.sampler import sample
from kvserve.engine.sequence import Sequence
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.sampling_params import SamplingParams

class _NgramIndex:
    """For each n in `sizes`: every n-gram of a token list that has a next token, mapped to where its latest
    occurrence's continuation starts. Grows with the list (an append-only list, as a sequence's tokens are)."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        # keyed by the n-gram's hash, not the n-gram: a fifth of the memory, and a collision costs only a draft
        # that verification rejects
        self.maps: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self.num_indexed = 0  # n-grams ending before this index are in the maps

    def update(self, tokens: list[int], offset: int = 0) -> None:
        """Index `tokens`' n-grams that have a next token (an n-gram ending at the last token is not: a lookup of
        the current suffix must find an earlier occurrence, not itself). `offset` tags positions (a corpus)."""
        for end in range(self.num_indexed, len(tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.maps[n][hash(tuple(tokens[end + 1 - n : end + 1]))] = offset + end + 1
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def find(self, tokens: list[int], n: int) -> int | None:
        """Where the continuation of the latest earlier occurrence of `tokens`' last n tokens starts."""
        return self.maps[n].get(hash(tuple(tokens[-n:]))) if len(tokens) >= n else None


class _RecentOutputs:
    """The last `capacity` finished requests' output tokens in one n-gram index (suffix decoding's global tree).
    Entries of requests pushed out are ignored when found, and dropped when they outnumber the live ones."""

    def __init__(self, capacity: int, depth: int):
        self.capacity = capacity
        self.sizes = range(1, depth + 1)
        self.outputs: deque[tuple[int, list[int], int]] = deque()  # (first corpus position, tokens, index entries)
        self.next_position = 0
        self.index = _NgramIndex(self.sizes)
        self.num_entries = self.num_live_entries = 0

    def add(self, tokens: list[int]) -> None:
        if len(tokens) < 2:
            return
        added = self._index(self.next_position, tokens)
        self.outputs.append((self.next_position, tokens, added))
        self.num_live_entries += added
        self.next_position += len(tokens) + 1  # a gap: no continuation runs from one output into the next
        while len(self.outputs) > self.capacity:
            self.num_live_entries -= self.outputs.popleft()[2]
        if self.num_entries > 2 * self.num_live_entries:  # mostly stale: rebuild from what is kept
            self.index, self.num_entries = _NgramIndex(self.sizes), 0
            for position, kept, _ in self.outputs:
                self._index(position, kept)

    def _index(self, position: int, tokens: list[int]) -> int:
        index = _NgramIndex(self.sizes)
        index.update(tokens, offset=position)
        added = 0
        for n, entries in index.maps.items():
            self.index.maps[n].update(entries)
            added += len(entries)
        self.num_entries += added
        return added

    def continuation(self, tokens: list[int], n: int, k: int) -> list[int]:
        position = self.index.find(tokens, n)
        if position is None or not self.outputs or position < self.outputs[0][0]:
            return []
        for first, output, _ in reversed(self.outputs):
            if first <= position < first + len(output):
                return output[position - first : position - first + k]
        return []


class DraftPolicy:
    """How many draft tokens pay for themselves, from what the engine measured: decode steps' seconds by their
    number of tokens, and how often draft tokens were accepted (per sequence, pulled toward all sequences' rate).

    A draft of m tokens accepted token by token with probability a adds a + a^2 + ... + a^m tokens to the step on
    average; it is kept only where that raises the step's tokens per second, t(T + m) against t(T) for a step of T
    tokens. On a CPU whose BLAS runs a few rows much slower than one (the AVX2-only AMD EPYC: 2-5 rows of SmolLM2's
    linears cost 2.5-3x one row) that rules out most drafts of a weakly predictable text; where a few rows cost
    about what one does, most drafts stay. A step size not measured yet is assumed to cost what the largest one
    measured below it cost, so it gets tried and measured; every EXPLORE_EVERY-th decision drafts in full, so the
    measurements follow the contexts as they grow."""

    EXPLORE_EVERY = 50
    PRIOR_WEIGHT = 4.0  # a sequence's acceptance starts as this many draft tokens at the global rate

    def __init__(self):
        self.step_seconds: dict[int, float] = {}  # decode-only steps: tokens in the step -> seconds (EMA)
        self.accepted, self.trials = 1.0, 2.0  # all sequences: accepted draft tokens, and accepted + first rejections
        self.num_decisions = 0

    def note_step(self, num_tokens: int, seconds: float) -> None:
        before = self.step_seconds.get(num_tokens)
        self.step_seconds[num_tokens] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def note_draft(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.trials += num_accepted + (num_accepted < num_proposed)

    def acceptance(self, accepted: float, trials: float) -> float:
        """The chance that a draft token is accepted, given a sequence's own counts (a geometric model)."""
        overall = self.accepted / self.trials
        return (accepted + self.PRIOR_WEIGHT * overall) / (trials + self.PRIOR_WEIGHT)

    def seconds(self, num_tokens: int) -> float | None:
        """A step of `num_tokens`: measured, or as the largest measured step below it (None: nothing measured)."""
        if num_tokens in self.step_seconds:
            return self.step_seconds[num_tokens]
        below = [n for n in self.step_seconds if n < num_tokens]
        return self.step_seconds[max(below)] if below else None

    def choose(self, num_step_tokens: int, expected_tokens: float, draft_len: int, acceptance: float) -> int:
        """How many of a draft's `draft_len` tokens to verify in a step already holding `num_step_tokens` tokens
        that are expected to yield `expected_tokens`."""
        self.num_decisions += 1
        if self.num_decisions % self.EXPLORE_EVERY == 0:
            return draft_len
        now = self.seconds(num_step_tokens)
        if now is None:
            return draft_len
        best, best_rate, gained = 0, expected_tokens / now, 0.0
        for m in range(1, draft_len + 1):
            gained += acceptance**m
            rate = (expected_tokens + gained) / self.seconds(num_step_tokens + m)
            if rate > best_rate:
                best, best_rate = m, rate
        return best


@dataclass
class SpeculationStats:
    """Counters in vLLM's terms: drafts verified, tokens proposed, tokens accepted (and by draft position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_by_position) < num_proposed:
            self.accepted_by_position += [0] * (num_proposed - len(self.accepted_by_position))
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1


class Speculator:
    """Proposes drafts for decoding sequences and samples the verification rows; the engine rolls the KV back."""

    def __init__(self, config: SpeculativeConfig, cache: PagedKVCache):
        self.config = config
        self.cache = cache
        self.max_batch = config.disable_by_batch_size
        self.paused = False  # beam search steps one token at a time
        self.stats = SpeculationStats()
        self.policy = DraftPolicy()
        self._step = (0, 0.0)  # this step so far: its tokens and the tokens they are expected to yield
        self._counts: dict[str, list[float]] = {}  # per sequence: accepted draft tokens, accepted + rejections
        if config.method == "ngram":
            self._sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
            self._recent = None
        else:
            self._sizes = range(1, config.suffix_decoding_max_tree_depth + 1)
            self._recent = _RecentOutputs(config.suffix_decoding_max_cached_requests,
                                          config.suffix_decoding_max_tree_depth)
        self._indexes: dict[str, _NgramIndex] = {}

    def describe(self) -> str:
        c = self.config
        if c.method == "ngram":
            how = f"prompt lookup of {c.prompt_lookup_min}..{c.prompt_lookup_max}-grams"
        else:
            how = (f"suffix match up to {c.suffix_decoding_max_tree_depth} tokens over the request and the last "
                   f"{c.suffix_decoding_max_cached_requests} outputs")
        return (f"speculative decoding: {c.method}, up to {c.num_speculative_tokens} draft tokens ({how}), while at "
                f"most {self.max_batch} sequences decode in a step (disable_by_batch_size)")

    def begin_step(self, num_step_tokens: int) -> None:
        """The scheduler starts a step whose other work is `num_step_tokens` tokens (each expected to yield one)."""
        self._step = (num_step_tokens, float(num_step_tokens))

    def note_step(self, num_tokens: int, seconds: float, decode_only: bool) -> None:
        """A step ran: its time, if it was decodes (and drafts) only, is what drafts are weighed against."""
        if decode_only:
            self.policy.note_step(num_tokens, seconds)

    def propose(self, seq: Sequence, max_tokens: int, num_decoding: int) -> list[int]:
        """Draft tokens to verify after `seq`'s last token this step: at most `max_tokens` (the step's token budget
        left), none while more than max_batch sequences decode, none past max_tokens or a block its format
        finalizes, and only as many as the measured step times and acceptance say pay (DraftPolicy)."""
        if self.paused or num_decoding > self.max_batch:
            return []
        limit = min(self.config.num_speculative_tokens, max_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        room = self.cache.max_draft_tokens(len(seq.token_ids) - 1)
        if room is not None:
            limit = min(limit, room)
        draft = self.lookup(seq, limit)[:limit] if limit > 0 else []
        if draft:
            accepted, trials = self._counts.get(seq.request_id, (0.0, 0.0))
            acceptance = self.policy.acceptance(accepted, trials)
            num_tokens, expected = self._step
            draft = draft[: self.policy.choose(num_tokens, expected, len(draft), acceptance)]
            self._step = (num_tokens + len(draft), expected + sum(acceptance**m for m in range(1, len(draft) + 1)))
        return draft

    def lookup(self, seq: Sequence, limit: int) -> list[int]:
        """The method's proposal of up to `limit` tokens to follow `seq`'s tokens (empty: no match)."""
        tokens = seq.token_ids
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = _NgramIndex(self._sizes)
        index.update(tokens)
        for n in reversed(self._sizes):
            start = index.find(tokens, n)
            draft = tokens[start : start + self._length(n, limit)] if start is not None else []
            if self._recent is not None and len(draft) < self._length(n, limit):
                draft = max(draft, self._recent.continuation(tokens, n, self._length(n, limit)), key=len)
            if draft:
                return draft
        return []

    def _length(self, matched: int, limit: int) -> int:
        if self.config.method == "ngram":
            return limit
        return min(limit, max(1, int(self.config.suffix_decoding_max_spec_factor * matched)))

    def finish(self, seq: Sequence) -> None:
        """Forget a finished sequence's index; suffix decoding keeps its output for later requests."""
        self._indexes.pop(seq.request_id, None)
        self._counts.pop(seq.request_id, None)
        if self._recent is not None and seq.num_output_tokens:
            self._recent.add(list(seq.output_token_ids))

    def sample_drafted(self, logits: torch.Tensor, seq: Sequence, draft: list[int],
                       generator: torch.Generator) -> tuple[list[tuple], int]:
        """Sample each of the 1 + len(draft) rows as a plain decode step would; returns the samples (token id,
        logprob, top logprobs) to append, the accepted drafts and then the one that ended the step, and how many
        draft tokens were accepted."""
        if seq.params.needs_penalties:  # penalties count the tokens before each row: the sequence's and the drafts
            rows = [_DraftedRow(seq, draft[:j]) for j in range(len(draft) + 1)]
        else:
            rows = [seq] * (len(draft) + 1)
        result = sample(logits, rows, generator)
        samples = list(zip(result.token_ids, result.logprobs, result.top_logprobs))
        accepted = 0
        while accepted < len(draft) and samples[accepted][0] == draft[accepted]:
            accepted += 1
        self.stats.record(len(draft), accepted)
        self.policy.note_draft(len(draft), accepted)
        counts = self._counts.setdefault(seq.request_id, [0.0, 0.0])
        counts[0] += accepted
        counts[1] += accepted + (accepted < len(draft))
        seq.num_draft_tokens += len(draft)
        seq.num_accepted_tokens += accepted
        return samples[: accepted + 1], accepted


@dataclass
class _DraftedRow:
    """What the sampler reads of a sequence, as of one verification row: its tokens and the drafts before it."""

    seq: Sequence
    drafts: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts
