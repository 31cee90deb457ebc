"""How much each stored token matters to each (layer, KV head), and how a layer's budget is split over its heads.

A scorer sees one sequence's stored keys and values of every layer and head at once ([L, H, K, D], padded, with
`valid` [L, H, K]) and the statistics of the queries that sequence has asked so far (QueryStats), and returns
scores [L, H, K] that are comparable across the heads of a layer (each head's scores are a distribution over its
keys, scaled by the value norms), so a layer's budget can be pooled over its heads:

- `expected` (ExpectedAttentionScorer, after NVIDIA kvpress's ExpectedAttentionPress): the attention a future query
  is expected to pay each key, its queries modelled as a Gaussian fitted to the sequence's queries so far (before
  RoPE) and rotated to the next `future_positions` positions on average: softmax(mean·k/√d + ½ kᵀΣk/d), averaged
  over the query heads of a KV head, times ‖v‖. Σ is kept per rotary pair (both dimensions of a pair share one
  variance), which makes it commute with RoPE's rotation, so only its shrinking by the averaged rotation remains.
- `knorm` (KeyNormScorer): keys with a small norm draw more attention (Devoto et al., 2024): softmax(−‖k‖) × ‖v‖.
- `keydiff` (KeyDiffScorer): keys least like the head's mean key are the distinctive ones (KeyDiff).
- `expected+keydiff` (UnionScorer): half of what a head keeps by each of the two rankings (expected attention keeps
  what the text reads, KeyDiff a fact no query has asked for yet).
- `observed` (ObservedAttentionScorer, SnapKV's observation window): the attention the sequence's latest
  WINDOW_QUERIES queries paid each key, averaged over them and the query heads of a KV head, times ‖v‖.
- `spanN(a)` (SpanScorer, after SnapKV's pooling): scorer a's scores max-pooled over a window of N tokens in
  each head's stream, so a kept token keeps the tokens beside it (a needle's digits and the words naming it).

`head_budgets` is AdaKV's allocation (Feng et al., 2024): a layer keeps `total` tokens over its heads, each head at
least its floor, the rest taken by the highest scores pooled over all the layer's heads."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from kvserve.rotation import apply_rotary


WINDOW_QUERIES = 128  # the observed scorer's window: the sequence's latest queries (docs/quality.md)


@dataclass
class QueryStats:
    """Running sums of one sequence's queries before RoPE, per layer and query head: [L, Hq, D] each."""

    total: torch.Tensor
    squares: torch.Tensor
    count: int = 0
    window: torch.Tensor | None = None  # [L, Hq, W, D]: the latest queries after RoPE, a ring (ObservedAttentionScorer)
    window_positions: torch.Tensor | None = None  # [W]: their positions (-1: a place not written yet)
    window_next: int = 0  # the ring's place the next query goes to

    @classmethod
    def empty(cls, num_layers: int, num_heads: int, head_dim: int) -> QueryStats:
        zeros = torch.zeros(num_layers, num_heads, head_dim)
        return cls(zeros, zeros.clone())

    def add(self, total: torch.Tensor, squares: torch.Tensor, count: int) -> None:
        self.total += total
        self.squares += squares
        self.count += count

    def copy(self) -> QueryStats:
        """Its own copy (a forked sequence's statistics start as its parent's)."""
        if self.window is None:
            return QueryStats(self.total.clone(), self.squares.clone(), self.count)
        return QueryStats(self.total.clone(), self.squares.clone(), self.count, self.window.clone(),
                          self.window_positions.clone(), self.window_next)

    def add_window(self, queries: torch.Tensor, positions: torch.Tensor, keep: int) -> None:
        """Queries [L, Hq, n, D] (after RoPE) at positions [n] join the window, a ring of the latest `keep`."""
        if self.window is None:
            L, Hq, _, D = queries.shape
            self.window = queries.new_zeros(L, Hq, keep, D)
            self.window_positions = torch.full((keep,), -1, dtype=torch.long)
        queries, positions = queries[:, :, -keep:], positions[-keep:]
        places = (self.window_next + torch.arange(positions.numel())) % keep
        self.window[:, :, places] = queries
        self.window_positions[places] = positions.long().cpu()
        self.window_next = int(places[-1] + 1) % keep

    def mean_and_pair_variance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean query [L, Hq, D] and each rotary pair's variance, repeated on both its dimensions [L, Hq, D]."""
        n = max(self.count, 1)
        mean = self.total / n
        variance = (self.squares / n - mean * mean).clamp_min(0)
        half = variance.shape[-1] // 2
        pair = (variance[..., :half] + variance[..., half:]) / 2
        return mean, torch.cat((pair, pair), dim=-1)


class Scorer:
    """Scores [L, H, K] of a sequence's stored tokens, comparable across the heads of a layer (see module doc)."""

    name = "?"
    window_queries = 0  # the latest queries of the sequence it reads (QueryStats.window)

    def score(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, stats: QueryStats,
              position: int, key_positions: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class KeyNormScorer(Scorer):
    name = "knorm"

    def score(self, keys, values, valid, stats, position, key_positions=None):
        logits = (-keys.float().norm(dim=-1)).masked_fill(~valid, float("-inf"))
        return logits.softmax(dim=-1) * values.float().norm(dim=-1)


class KeyDiffScorer(Scorer):
    """Keys unlike the head's mean key are the distinctive ones (KeyDiff, Park et al., 2025): 1 − cos(k, mean key),
    made a distribution over the head's keys, times ‖v‖."""

    name = "keydiff"

    def score(self, keys, values, valid, stats, position, key_positions=None):
        keys = keys.float() * valid[..., None]
        anchor = keys.sum(dim=2, keepdim=True) / valid.sum(-1, keepdim=True)[..., None].clamp_min(1)
        distinct = (1 + 1e-6 - torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)) * valid  # > 0: one key too
        return distinct / distinct.sum(-1, keepdim=True).clamp_min(1e-12) * values.float().norm(dim=-1)


class ExpectedAttentionScorer(Scorer):
    """Expected attention of future queries (module doc). `inv_freq` and `attention_factor` are the model's RoPE."""

    name = "expected"

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0, future_positions: int = 512):
        self.inv_freq = inv_freq.double()
        self.attention_factor = attention_factor
        self.future_positions = future_positions

    def averaged_rotation(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of RoPE averaged over the next `future_positions` positions after `position`, [D] each."""
        future = torch.arange(position + 1, position + 1 + self.future_positions, dtype=torch.float64)
        angles = future[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos().mean(0), angles.sin().mean(0)
        return (torch.cat((cos, cos)) * self.attention_factor).float(), (torch.cat((sin, sin)) *
                                                                          self.attention_factor).float()

    def score(self, keys, values, valid, stats, position, key_positions=None):
        L, H, K, D = keys.shape
        mean, pair_variance = stats.mean_and_pair_variance()  # [L, Hq, D]
        per_kv = mean.shape[1] // H
        cos, sin = self.averaged_rotation(position)
        mean = apply_rotary(mean, cos, sin)  # the averaged rotation of the mean query
        shrink = cos * cos + sin * sin  # what the averaged rotation does to a pair's isotropic variance
        keys = keys.float()
        mean = mean.view(L, H, per_kv, D)
        variance = (pair_variance * shrink).view(L, H, per_kv, D)
        logits = mean @ keys.transpose(-1, -2) / math.sqrt(D)  # [L, H, per_kv, K]
        logits = logits + (variance @ (keys * keys).transpose(-1, -2)) / (2 * D)
        logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
        return logits.softmax(dim=-1).mean(dim=2) * values.float().norm(dim=-1)


class ObservedAttentionScorer(Scorer):
    """The attention the sequence's latest queries paid each key (SnapKV's observation window, Li et al., 2024):
    softmax(q·k/√d) of each of the window's queries over the keys it could see (key position ≤ its own), averaged
    over the window and the query heads of a KV head, times ‖v‖."""

    name = "observed"
    window_queries = WINDOW_QUERIES

    def score(self, keys, values, valid, stats, position, key_positions=None):
        L, H, K, D = keys.shape
        value_norms = values.float().norm(dim=-1)
        if stats is None or stats.window is None:  # no query yet: nothing to tell the keys apart
            return valid.float() * value_norms
        window = stats.window  # [L, Hq, W, D]
        per_kv, W = window.shape[1] // H, window.shape[2]
        logits = (window.reshape(L, H, per_kv * W, D) @ keys.float().transpose(-1, -2)).div_(math.sqrt(D))
        query_positions = stats.window_positions.repeat(per_kv)  # rows: per_kv blocks of the W queries
        # one comparison hides what a query cannot see: padding (placed past every query), keys after its own
        # position, and every key from a ring place not written yet (position -1)
        if key_positions is None:  # no positions given: every stored key as old as the first token
            key_positions = torch.zeros_like(valid, dtype=torch.long)
        far = torch.iinfo(torch.long).max
        hidden = key_positions.long().masked_fill(~valid, far)[:, :, None, :] > query_positions[None, None, :, None]
        probs = logits.masked_fill_(hidden, float("-inf")).softmax(dim=-1).nan_to_num_(0.0)
        rows = int((query_positions >= 0).sum())
        return probs.sum(dim=2) / max(rows, 1) * value_norms


def ranks(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each key's place in its head's order, best first (0), [L, H, K]; padding after every valid key."""
    order = scores.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    return order.argsort(dim=-1)


class UnionScorer(Scorer):
    """The union of two scorers' rankings (`perhead-mix`: expected attention and KeyDiff, half each): a head that
    keeps n tokens keeps those placed before n·share in the first ranking or before n·(1 − share) in the second,
    the cut moved until the union holds n, so neither scorer alone decides what goes. Expected attention keeps what
    the queries so far read (the text's perplexity); KeyDiff keeps what is unlike the rest, as a fact in filler text
    is, before any query asks for it. A key's score is the first scorer's score of the same place in its head's
    order (the k-th key of the union gets the first ranking's k-th highest score), so heads compare as under the
    first scorer."""

    def __init__(self, first: Scorer, second: Scorer, share: float = 0.5):
        if not 0 < share < 1:
            raise ValueError(f"the first scorer's share of a union must be in (0, 1), not {share}")
        self.first, self.second, self.share = first, second, share
        self.window_queries = max(first.window_queries, second.window_queries)
        self.name = f"{first.name}+{second.name}"

    def score(self, keys, values, valid, stats, position, key_positions=None):
        first = self.first.score(keys, values, valid, stats, position, key_positions)
        second = self.second.score(keys, values, valid, stats, position, key_positions)
        place = torch.minimum(ranks(first, valid).double() / self.share,
                              ranks(second, valid).double() / (1 - self.share))
        order = place.masked_fill(~valid, float("inf")).argsort(dim=-1, stable=True).argsort(dim=-1)
        return first.sort(dim=-1, descending=True).values.gather(-1, order)


class SpanScorer(Scorer):
    """Another scorer's scores, each key's raised to the highest among the `window` keys centred on it in its head's
    stream (SnapKV's max-pool). A stream holds its kept tokens in position order, so the neighbours are the nearest
    kept tokens either side; a token that scores high brings its span, as a needle's number brings its key."""

    def __init__(self, inner: Scorer, window: int):
        if window < 1 or window % 2 == 0:
            raise ValueError(f"a span window must be an odd number of tokens (1, 3, 5, ...), not {window}")
        self.inner, self.window = inner, window
        self.window_queries = inner.window_queries
        self.name = f"span{window}({inner.name})"

    def score(self, keys, values, valid, stats, position, key_positions=None):
        scores = self.inner.score(keys, values, valid, stats, position, key_positions)
        return pool_spans(scores, valid, self.window)


def pool_spans(scores: torch.Tensor, valid: torch.Tensor, window: int) -> torch.Tensor:
    """Each valid key's score raised to the highest valid one within window // 2 places either side, [L, H, K]."""
    L, H, K = scores.shape
    padded = scores.masked_fill(~valid, float("-inf")).reshape(L * H, 1, K)
    pooled = torch.nn.functional.max_pool1d(padded, window, stride=1, padding=window // 2).reshape(L, H, K)
    return torch.where(valid, pooled, scores)


def make_scorer(name: str, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> Scorer:
    """The scorer a name gives: `expected`, `keydiff`, `knorm`, `a+b` (their union, half each) or `spanN(a)` (a's
    scores pooled over N tokens)."""
    if "+" in name:
        first, second = name.split("+", 1)
        return UnionScorer(make_scorer(first, inv_freq, attention_factor),
                           make_scorer(second, inv_freq, attention_factor))
    span = re.fullmatch(r"span(\d+)\((.+)\)", name)
    if span:
        return SpanScorer(make_scorer(span[2], inv_freq, attention_factor), int(span[1]))
    if name == "knorm":
        return KeyNormScorer()
    if name == "keydiff":
        return KeyDiffScorer()
    if name == "expected":
        return ExpectedAttentionScorer(inv_freq, attention_factor)
    if name == "observed":
        return ObservedAttentionScorer()
    raise ValueError(f"unknown KV scorer {name!r}; choose expected, keydiff, knorm, a union a+b or a span spanN(a)")


def window_queries(name: str) -> int:
    """How many of a sequence's latest queries the scorer `name` reads (kept beside its streams)."""
    return make_scorer(name, torch.ones(1)).window_queries


def head_budgets(scores: torch.Tensor, valid: torch.Tensor, floors: torch.Tensor, totals: torch.Tensor
                 ) -> torch.Tensor:
    """AdaKV: tokens each head keeps, [L, H], from scores [L, H, K] (valid [L, H, K]), each head's floor [L, H]
    (at most its valid tokens) and each layer's total [L] (at most its valid tokens, at least its floors'
    sum). The rest of a layer's total beyond its floors goes to the highest scores among all its heads' tokens past
    their own floor (each head's best tokens first), so the budgets of a layer sum to its total."""
    L, H, K = scores.shape
    ranked = scores.masked_fill(~valid, float("-inf")).sort(dim=-1, descending=True).values  # [L, H, K]
    past_floor = torch.arange(K)[None, None, :] >= floors[..., None]
    pooled = ranked.masked_fill(~past_floor, float("-inf")).reshape(L, H * K)
    order = pooled.argsort(dim=-1, descending=True, stable=True)
    rest = (totals - floors.sum(dim=1)).clamp_min(0)  # [L]
    taken = torch.arange(H * K)[None, :] < rest[:, None]  # the first `rest` of each layer's pooled order
    head_of = torch.div(order, K, rounding_mode="floor")
    extra = torch.zeros(L, H, dtype=torch.long).scatter_add_(1, head_of, taken.long())
    return floors + extra
