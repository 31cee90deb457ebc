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


@dataclass
class QueryStats:
    """Running sums of one sequence's queries before RoPE, per layer and query head: [L, Hq, D] each."""

    total: torch.Tensor
    squares: torch.Tensor
    count: int = 0

    @classmethod
    def empty(cls, num_layers: int, num_heads: int, head_dim: int) -> QueryStats:
        zeros = torch.zeros(num_layers, num_heads, head_dim)
        return cls(zeros, zeros.clone())

    def add(self, total: torch.Tensor, squares: torch.Tensor, count: int) -> None:
        self.total += total
        self.squares += squares
        self.count += count

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

    def score(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, stats: QueryStats,
              position: int) -> torch.Tensor:
        raise NotImplementedError


class KeyNormScorer(Scorer):
    name = "knorm"

    def score(self, keys, values, valid, stats, position):
        logits = (-keys.float().norm(dim=-1)).masked_fill(~valid, float("-inf"))
        return logits.softmax(dim=-1) * values.float().norm(dim=-1)


class KeyDiffScorer(Scorer):
    """Keys unlike the head's mean key are the distinctive ones (KeyDiff, Park et al., 2025): 1 − cos(k, mean key),
    made a distribution over the head's keys, times ‖v‖."""

    name = "keydiff"

    def score(self, keys, values, valid, stats, position):
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

    def score(self, keys, values, valid, stats, position):
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
        self.name = f"{first.name}+{second.name}"

    def score(self, keys, values, valid, stats, position):
        first = self.first.score(keys, values, valid, stats, position)
        second = self.second.score(keys, values, valid, stats, position)
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
        self.name = f"span{window}({inner.name})"

    def score(self, keys, values, valid, stats, position):
        scores = self.inner.score(keys, values, valid, stats, position)
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
    raise ValueError(f"unknown KV scorer {name!r}; choose expected, keydiff, knorm, a union a+b or a span spanN(a)")


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
