"""Scores per (layer, KV head) and AdaKV's budgets: a layer's budgets sum to its total, every head gets its floor,
the pooled rest goes to the highest scores; expected attention ranks the keys a query distribution points at; the
union of two rankings keeps each one's best, where either alone drops one of them; a span scorer keeps a high
key's neighbours; the observed scorer averages the attention its window of queries paid, each query over the keys
up to its own position."""
import math

import pytest
import torch

from kvserve.kv.scorers import (ExpectedAttentionScorer, KeyDiffScorer, KeyNormScorer, ObservedAttentionScorer,
                                 QueryStats, Scorer, SpanScorer, UnionScorer, head_budgets, make_scorer, ranks)


@pytest.mark.parametrize("seed", range(5))
def test_budgets_sum_to_each_layers_total_and_respect_the_floors(seed):
    g = torch.Generator().manual_seed(seed)
    L, H, K = 3, 4, 40
    stored = torch.randint(10, K + 1, (L, H), generator=g)
    valid = torch.arange(K)[None, None, :] < stored[..., None]
    scores = torch.rand(L, H, K, generator=g)
    floors = torch.minimum(torch.randint(0, 8, (L, H), generator=g), stored)
    totals = torch.minimum(torch.randint(20, 100, (L,), generator=g), valid.sum((1, 2)))
    totals = torch.maximum(totals, floors.sum(1))
    budgets = head_budgets(scores, valid, floors, totals)
    assert torch.equal(budgets.sum(1), totals)
    assert bool((budgets >= floors).all()) and bool((budgets <= stored).all())


def test_the_pooled_rest_goes_to_the_head_with_the_highest_scores():
    valid = torch.ones(1, 2, 8, dtype=torch.bool)
    scores = torch.stack([torch.full((8,), 0.01), torch.linspace(1, 0.5, 8)])[None]  # head 1 dominates
    budgets = head_budgets(scores, valid, torch.tensor([[2, 2]]), torch.tensor([8]))
    assert budgets.tolist() == [[2, 6]]


def test_expected_attention_ranks_the_key_along_the_mean_query_first():
    D = 8
    mean = torch.zeros(D)
    mean[0] = 4.0  # queries point along dimension 0 (a slow rotary pair: inv_freq tiny, so rotation barely moves it)
    stats = QueryStats(mean.repeat(1, 2, 1) * 10, torch.zeros(1, 2, D), count=10)  # two query heads, one KV head
    keys = torch.zeros(1, 1, 3, D)
    keys[0, 0, 0, 1] = 1.0
    keys[0, 0, 1, 0] = 1.0  # along the mean
    keys[0, 0, 2, 0] = -1.0
    values = torch.ones(1, 1, 3, D)
    inv_freq = torch.tensor([1e-6, 1.0, 1.0, 1.0])
    scores = ExpectedAttentionScorer(inv_freq).score(keys, values, torch.ones(1, 1, 3, dtype=torch.bool), stats, 100)
    assert scores[0, 0].argmax() == 1 and scores[0, 0].argmin() == 2
    expected = torch.softmax(torch.tensor([0.0, 4.0, -4.0]) / math.sqrt(D), 0) * math.sqrt(D)
    torch.testing.assert_close(scores[0, 0], expected, atol=1e-4, rtol=1e-4)


def test_scores_of_padding_are_zero_and_heads_are_distributions_times_value_norms():
    keys = torch.randn(2, 3, 10, 8)
    values = torch.ones(2, 3, 10, 8)
    valid = torch.arange(10)[None, None, :] < torch.tensor([[10, 6, 3], [1, 10, 9]])[..., None]
    for scorer in (KeyNormScorer(), KeyDiffScorer(), ExpectedAttentionScorer(torch.ones(4))):
        stats = QueryStats(torch.randn(2, 6, 8), torch.rand(2, 6, 8) + 1, count=1)
        scores = scorer.score(keys, values, valid, stats, 50)
        assert bool((scores[~valid] == 0).all())
        torch.testing.assert_close(scores.sum(-1), torch.full((2, 3), math.sqrt(8)))


def test_keydiff_ranks_the_key_unlike_the_others_first():
    keys = torch.ones(1, 1, 6, 4) + 0.01 * torch.randn(1, 1, 6, 4, generator=torch.Generator().manual_seed(0))
    keys[0, 0, 3] = torch.tensor([1.0, -1.0, 1.0, -1.0])  # the needle among look-alikes
    scores = KeyDiffScorer().score(keys, torch.ones_like(keys), torch.ones(1, 1, 6, dtype=torch.bool), None, 0)
    assert int(scores[0, 0].argmax()) == 3


def read_and_needle_case():
    """One head's keys: a key the queries so far read (along their mean: expected attention's first, but a look-alike
    of the mean key), six filler keys near it and a needle unlike them all that no query has read yet."""
    D = 8
    g = torch.Generator().manual_seed(0)
    keys = torch.zeros(1, 1, 8, D)
    keys[0, 0, :6, 0] = 1.0
    keys[0, 0, :6, 1:] = 0.3 * torch.randn(6, D - 1, generator=g)  # filler: along the queries, noisy
    keys[0, 0, 6, 0] = 3.0  # read: along the queries, exactly
    keys[0, 0, 7, 2] = 1.0  # needle: across them
    mean = torch.zeros(D)
    mean[0] = 4.0
    stats = QueryStats(mean.repeat(1, 2, 1) * 10, torch.zeros(1, 2, D), count=10)
    inv_freq = torch.tensor([1e-6, 1e-6, 1e-6, 1e-6])  # no rotation to speak of
    return keys, torch.ones_like(keys), torch.ones(1, 1, 8, dtype=torch.bool), stats, inv_freq


def top(scores: torch.Tensor, n: int) -> set[int]:
    return set(scores[0, 0].argsort(descending=True, stable=True)[:n].tolist())


def test_the_union_keeps_the_read_key_and_the_needle_where_each_scorer_alone_drops_one():
    keys, values, valid, stats, inv_freq = read_and_needle_case()
    expected = ExpectedAttentionScorer(inv_freq).score(keys, values, valid, stats, 100)
    keydiff = KeyDiffScorer().score(keys, values, valid, stats, 100)
    union = make_scorer("expected+keydiff", inv_freq).score(keys, values, valid, stats, 100)
    assert 6 in top(expected, 2) and 7 not in top(expected, 2)  # the needle is not read: expected attention drops it
    assert 7 in top(keydiff, 2) and 6 not in top(keydiff, 2)  # the read key is a look-alike: KeyDiff drops it
    assert top(union, 2) == {6, 7}


class Fixed(Scorer):
    def __init__(self, scores: torch.Tensor):
        self.scores = scores

    def score(self, keys, values, valid, stats, position, key_positions=None):
        return self.scores


@pytest.mark.parametrize("seed", range(5))
def test_the_union_keeps_half_of_what_a_head_keeps_by_each_ranking_and_scores_as_the_first(seed):
    g = torch.Generator().manual_seed(seed)
    L, H, K = 2, 3, 30
    valid = torch.arange(K)[None, None, :] < torch.randint(5, K + 1, (L, H), generator=g)[..., None]
    first, second = torch.rand(L, H, K, generator=g) * valid, torch.rand(L, H, K, generator=g) * valid
    union = UnionScorer(Fixed(first), Fixed(second)).score(None, None, valid, None, 0)
    # each head's scores are the first scorer's, reordered: heads compare (and AdaKV pools) as under it
    torch.testing.assert_close(union.sort(-1).values, first.sort(-1).values, atol=0, rtol=0)
    place, first_place, second_place = ranks(union, valid), ranks(first, valid), ranks(second, valid)
    for n in range(1, K + 1):
        kept = valid & (place < n)
        assert torch.equal(kept.sum(-1), valid.sum(-1).clamp_max(n))
        best_of_each = valid & ((first_place < n // 2) | (second_place < n // 2))
        assert bool((kept | ~best_of_each).all())  # the best n // 2 of each ranking are among the n kept
    totals = valid.sum((1, 2)) // 2
    floors = torch.zeros(L, H, dtype=torch.long)
    assert torch.equal(head_budgets(union, valid, floors, totals).sum(1), totals)


def test_a_union_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="share"):
        UnionScorer(KeyNormScorer(), KeyDiffScorer(), share=1.0)


def needle_case() -> tuple[torch.Tensor, torch.Tensor]:
    """One head of 20 keys, the last 4 padding: key 9 scores far above the rest, keys 8 and 10 below most of them."""
    scores = torch.linspace(0.1, 0.5, 20)[None, None, :].clone()
    scores[0, 0, 9], scores[0, 0, 8], scores[0, 0, 10] = 5.0, 0.01, 0.02
    valid = torch.arange(20)[None, None, :] < 16
    return scores * valid, valid


def test_a_span_keeps_the_neighbours_of_a_high_key_that_token_ranking_drops():
    scores, valid = needle_case()
    plain = set(ranks(scores, valid)[0, 0].argsort()[:3].tolist())
    spans = SpanScorer(Fixed(scores), 3).score(None, None, valid, None, 0)
    pooled = set(ranks(spans, valid)[0, 0].argsort()[:3].tolist())
    assert 9 in plain and not {8, 10} & plain  # alone, the needle's neighbours are among the first dropped
    assert pooled == {8, 9, 10}
    assert torch.equal(spans[~valid], scores[~valid])  # padding neither takes nor lends a score
    assert spans[0, 0, 15] == scores[0, 0, 15]  # the last valid key is not raised by the padding past it


def test_a_union_with_a_spanned_half_keeps_the_span_and_exact_counts():
    scores, valid = needle_case()
    first = torch.linspace(1.0, 0.1, 20)[None, None, :] * valid  # the first ranking prefers the earliest keys
    union = UnionScorer(Fixed(first), SpanScorer(Fixed(scores), 5)).score(None, None, valid, None, 0)
    place = ranks(union, valid)
    assert {7, 8, 9, 10, 11} <= set(place[0, 0].argsort()[:10].tolist())
    for n in range(1, 21):
        assert int((valid & (place < n)).sum()) == min(n, 16)
    assert torch.equal(head_budgets(union, valid, torch.zeros(1, 1, dtype=torch.long), torch.tensor([6])),
                       torch.tensor([[6]]))


@pytest.mark.parametrize("window", [0, -1, 2, 4])
def test_a_span_window_that_is_not_a_positive_odd_count_is_refused(window):
    with pytest.raises(ValueError, match="odd number of tokens"):
        SpanScorer(KeyDiffScorer(), window)


def test_make_scorer_builds_spans_inside_a_union():
    scorer = make_scorer("expected+span5(keydiff)", torch.ones(4))
    assert isinstance(scorer, UnionScorer) and isinstance(scorer.second, SpanScorer)
    assert scorer.second.window == 5 and isinstance(scorer.second.inner, KeyDiffScorer)
    with pytest.raises(ValueError, match="unknown KV scorer 'nothing'"):
        make_scorer("span5(nothing)", torch.ones(4))


def test_observed_attention_is_the_windows_causal_softmax_averaged_over_queries_and_heads():
    g = torch.Generator().manual_seed(3)
    L, H, per_kv, W, K, D = 2, 2, 3, 4, 7, 8
    keys, values = torch.randn(L, H, K, D, generator=g), torch.randn(L, H, K, D, generator=g)
    valid = torch.arange(K)[None, None, :] < torch.tensor([[7, 5], [6, 7]])[..., None]
    key_positions = torch.arange(K).expand(L, H, K)
    stats = QueryStats.empty(L, H * per_kv, D)
    stats.add_window(torch.randn(L, H * per_kv, W, D, generator=g), torch.tensor([2, 3, 5, 6]), keep=W + 3)
    scores = ObservedAttentionScorer().score(keys, values, valid, stats, 7, key_positions)
    for layer in range(L):
        for h in range(H):
            rows = []
            for qh in range(h * per_kv, (h + 1) * per_kv):  # the ring's three places not written: no rows
                for w, pos in enumerate([2, 3, 5, 6]):
                    seen = valid[layer, h] & (key_positions[layer, h] <= pos)
                    logits = stats.window[layer, qh, w] @ keys[layer, h].T / math.sqrt(D)
                    rows.append(logits.masked_fill(~seen, float("-inf")).softmax(-1))
            want = torch.stack(rows).mean(0) * values[layer, h].norm(dim=-1)
            torch.testing.assert_close(scores[layer, h], want)
    assert bool((scores[:, :, 6:][~valid[:, :, 6:]] == 0).all())
    unplaced = ObservedAttentionScorer().score(keys, values, valid, stats, 7)  # no positions: every query sees all
    seen = [torch.stack([(stats.window[layer, qh, :W] @ keys[layer, h].T / math.sqrt(D))
                         .masked_fill(~valid[layer, h], float("-inf")).softmax(-1)
                         for qh in range(h * per_kv, (h + 1) * per_kv)]).mean((0, 1)) * values[layer, h].norm(dim=-1)
            for layer in range(L) for h in range(H)]
    torch.testing.assert_close(unplaced, torch.stack(seen).view(L, H, K))
    assert float(scores[0, 0, 6]) > 0 and float(scores[0, 0, 6]) < float(scores[0, 0, :6].max())  # one query saw it


def test_the_window_keeps_the_latest_queries_and_a_copy_is_its_own():
    stats = QueryStats.empty(1, 2, 4)
    stats.add_window(torch.full((1, 2, 2, 4), -1.0), torch.arange(-2, 0), keep=5)
    assert stats.window_positions.tolist() == [-2, -1, -1, -1, -1]  # -1: places not written yet
    for start in (0, 3, 6):
        stats.add_window(torch.arange(start, start + 3).float()[None, None, :, None].expand(1, 2, 3, 4),
                         torch.arange(start, start + 3), keep=5)
    order = stats.window_positions.argsort()
    assert stats.window_positions[order].tolist() == [4, 5, 6, 7, 8]
    assert stats.window[0, 1, order, 0].tolist() == [4, 5, 6, 7, 8]  # each query beside its position
    stats.add_window(torch.zeros(1, 2, 7, 4), torch.arange(9, 16), keep=5)  # more than the ring: the latest
    assert sorted(stats.window_positions.tolist()) == [11, 12, 13, 14, 15]
    child = stats.copy()
    child.add_window(torch.ones(1, 2, 1, 4), torch.tensor([16]), keep=5)
    child.total += 1
    assert sorted(stats.window_positions.tolist()) == [11, 12, 13, 14, 15] and float(stats.total.sum()) == 0
    assert float(stats.window.sum()) == 0


def test_observed_attention_without_queries_yet_keeps_no_key_over_another():
    keys, values = torch.randn(1, 1, 5, 4), torch.ones(1, 1, 5, 4)
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    scores = ObservedAttentionScorer().score(keys, values, valid, QueryStats.empty(1, 1, 4), 5)
    assert scores.unique().numel() == 1
    observed = ObservedAttentionScorer.window_queries
    assert make_scorer("observed+span9(keydiff)", torch.ones(2)).window_queries == observed
    assert make_scorer("expected+span9(keydiff)", torch.ones(2)).window_queries == 0
