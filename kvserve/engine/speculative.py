"""Speculative decoding without a draft model: propose the next tokens from text the request (or recent requests)
already hold, verify them all in one forward pass, and keep the longest prefix the model agrees with.

Proposing, at schedule time (`Speculator.propose`):
- "ngram" (prompt lookup, vLLM's `ngram`, llama.cpp's lookup decoding): the last n tokens, n from
  prompt_lookup_max down to prompt_lookup_min, looked up in the request's own prompt and output; the tokens that
  followed their latest earlier occurrence are the draft (one that runs into the present, as in a loop, repeats
  its cycle).
- "suffix" (after suffix decoding): the longest suffix of the request, up to suffix_decoding_max_tree_depth tokens,
  that occurs earlier in the request or in one of the last suffix_decoding_max_cached_requests requests' outputs
  (which repeat across templated and agentic traffic) of the same cache_salt; it proposes up to
  suffix_decoding_max_spec_factor tokens per matched token. An n-gram index per depth stands in for the suffix tree (same matches, no frequency pruning).
The scheduler gives a drafted sequence 1 + k tokens: its last token and the draft, in slots of its own blocks.

Verifying, after the forward pass (`sample_drafted`): row j of a drafted sequence's logits is the distribution of
the token after the last token and draft tokens 1..j. Every row is sampled exactly as a plain decode step samples
(penalties see the drafts before it, a constrained sequence's grammar masks it as of them: its draft was cut
where the grammar stops taking it); the draft is accepted up to the first row whose sample differs from it, and
that row's sample ends the step. Greedy, the tokens are exactly plain decoding's. Sampling: a proposal that is one
fixed token is a draft distribution q that is one-hot, for which the rejection sampler (Leviathan et al., Chen et
al.) accepts d with probability min(1, p(d)/q(d)) = p(d) and on rejection samples from max(0, p - q) renormalized
= p without d; "sample t ~ p, accept while t == d" is that sampler, so every output token has the target's
distribution. The engine then rolls the K/V back: the sequence's computed tokens stop after the accepted ones, the
blocks only rejected tokens were written to go back to the pool (`KVCacheManager.trim`), slots of rejected tokens
in a kept block are written again by later tokens, and only computed (accepted) tokens are ever hashed into the
prefix index. A hybrid model's linear-attention state is set back to the last accepted token as well
(kv/draft_states.py)."""
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
    """Finished requests' output tokens in one n-gram index (suffix decoding's global tree), oldest first. Entries
    of outputs dropped are ignored when found, and dropped themselves when they outnumber the live ones."""

    def __init__(self, depth: int):
        self.sizes = range(1, depth + 1)
        self.outputs: deque[tuple[int, list[int], int]] = deque()  # (first corpus position, tokens, index entries)
        self.next_position = 0
        self.index = _NgramIndex(self.sizes)
        self.num_entries = self.num_live_entries = 0

    def add(self, tokens: list[int]) -> None:
        added = self._index(self.next_position, tokens)
        self.outputs.append((self.next_position, tokens, added))
        self.num_live_entries += added
        self.next_position += len(tokens) + 1  # a gap: no continuation runs from one output into the next

    def drop_oldest(self) -> None:
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


class _OutputsBySalt:
    """The last `capacity` finished requests' outputs, in one index per cache_salt: one tenant's outputs never
    become another's drafts (the tokens would be the same, but speed would depend on other tenants' text). The
    capacity is shared, so memory stays bounded however many salts come: the oldest output of all is dropped."""

    def __init__(self, capacity: int, depth: int):
        self.capacity, self.depth = capacity, depth
        self.by_salt: dict[str | None, _RecentOutputs] = {}
        self.order: deque[str | None] = deque()  # each kept output's salt, oldest first

    def add(self, salt: str | None, tokens: list[int]) -> None:
        if len(tokens) < 2:
            return
        self.by_salt.setdefault(salt, _RecentOutputs(self.depth)).add(tokens)
        self.order.append(salt)
        while len(self.order) > self.capacity:
            oldest = self.order.popleft()
            self.by_salt[oldest].drop_oldest()
            if not self.by_salt[oldest].outputs:
                del self.by_salt[oldest]

    def continuation(self, salt: str | None, tokens: list[int], n: int, k: int) -> list[int]:
        recent = self.by_salt.get(salt)
        return recent.continuation(tokens, n, k) if recent is not None else []

    @property
    def num_entries(self) -> int:
        return sum(recent.num_entries for recent in self.by_salt.values())


def _continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """Up to k tokens from `start`. A continuation that runs into the present (a loop such as "a a a a", whose
    latest earlier occurrence ends one token back) goes on by repeating its cycle, as the loop would."""
    period = len(tokens) - start
    return [tokens[start + i % period] for i in range(k)]


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

    def as_dict(self) -> dict[str, int | list[int]]:
        """The counters under the engine's stats keys."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_accepted_by_position": list(self.accepted_by_position)}


class Speculator:
    """Proposes drafts for decoding sequences and samples the verification rows; the engine rolls the KV back."""

    def __init__(self, config: SpeculativeConfig, cache: PagedKVCache):
        self.config = config
        self.cache = cache
        self.max_batch = config.disable_by_batch_size
        self.paused = False  # beam search steps one token at a time
        self.stats = SpeculationStats()
        if config.method == "ngram":
            self._sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
            self._recent = None
        else:
            self._sizes = range(1, config.suffix_decoding_max_tree_depth + 1)
            self._recent = _OutputsBySalt(config.suffix_decoding_max_cached_requests,
                                          config.suffix_decoding_max_tree_depth)
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, seq: Sequence, max_tokens: int, num_decoding: int) -> list[int]:
        """Draft tokens to verify after `seq`'s last token this step: at most `max_tokens` (the step's token budget
        left), none while more than max_batch sequences decode, none past max_tokens or a block its format
        finalizes."""
        if self.paused or num_decoding > self.max_batch:
            return []
        limit = min(self.config.num_speculative_tokens, max_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        room = self.cache.max_draft_tokens(len(seq.token_ids) - 1)
        if room is not None:
            limit = min(limit, room)
        draft = self.lookup(seq, limit)[:limit] if limit > 0 else []
        if seq.grammar is not None and draft:  # a constrained sequence drafts only what its grammar takes next
            draft = seq.grammar.valid_draft(draft, seq.eos_token_ids)
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
            draft = _continuation(tokens, start, self._length(n, limit)) if start is not None else []
            if self._recent is not None and len(draft) < self._length(n, limit):
                found = self._recent.continuation(seq.cache_salt, tokens, n, self._length(n, limit))
                draft = max(draft, found, key=len)
            if draft:
                return draft
        return []

    def _length(self, matched: int, limit: int) -> int:
        if self.config.method == "ngram":
            return limit
        return min(limit, max(1, int(self.config.suffix_decoding_max_spec_factor * matched)))

    def forget_outputs(self) -> None:
        """Drop what suffix decoding keeps of finished requests (benchmarks: a timed run must not find the answers
        an earlier run of the same prompts left)."""
        if self._recent is not None:
            self._recent = _OutputsBySalt(self._recent.capacity, self._recent.depth)

    def finish(self, seq: Sequence) -> None:
        """Forget a finished sequence's index; suffix decoding keeps its output for later requests."""
        self._indexes.pop(seq.request_id, None)
        if self._recent is not None and seq.num_output_tokens:
            self._recent.add(seq.cache_salt, list(seq.output_token_ids))

    def sample_drafted(self, logits: torch.Tensor, seq: Sequence, draft: list[int],
                       generator: torch.Generator) -> tuple[list[tuple], int]:
        """Sample each of the 1 + len(draft) rows as a plain decode step would; returns the samples (token id,
        logprob, top logprobs) to append, the accepted drafts and then the one that ended the step, and how many
        draft tokens were accepted."""
        # row j is the sequence as of its first j drafts: penalties count them, a seeded row draws by its position
        # (engine/sampler.py), and a constrained row is masked by the grammar as of them
        masks = seq.grammar.draft_masks(draft) if seq.grammar is not None else None
        rows = [_DraftedRow(seq, draft[:j], _RowMask(masks[j]) if masks is not None else None)
                for j in range(len(draft) + 1)]
        result = sample(logits, rows, generator)
        samples = list(zip(result.token_ids, result.logprobs, result.top_logprobs))
        accepted = 0
        while accepted < len(draft) and samples[accepted][0] == draft[accepted]:
            accepted += 1
        self.stats.record(len(draft), accepted)
        seq.num_draft_tokens += len(draft)
        seq.num_accepted_tokens += accepted
        return samples[: accepted + 1], accepted


@dataclass
class _RowMask:
    """A verification row's grammar mask, computed with the draft's (GrammarMatcher.draft_masks), as the sampler
    reads a sequence's grammar (structured.grammar_bitmask)."""

    bitmask_row: torch.Tensor

    @property
    def num_words(self) -> int:
        return self.bitmask_row.shape[0]

    def fill(self, bitmask_row: torch.Tensor) -> None:
        bitmask_row.copy_(self.bitmask_row)


@dataclass
class _DraftedRow:
    """What the sampler reads of a sequence, as of one verification row: its tokens and the drafts before it, and
    a constrained sequence's grammar mask there."""

    seq: Sequence
    drafts: list[int]
    grammar: _RowMask | None = None

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def seed(self) -> int | None:
        return self.seq.seed

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts
