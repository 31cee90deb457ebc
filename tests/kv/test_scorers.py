"""Scores per (layer, KV head) and AdaKV's budgets: a layer's budgets sum to its total, every head gets its floor,
the pooled rest goes to the highest scores; expected attention ranks the keys a query distribution points at."""
import math

import pytest
import torch

from kvserve.kv.scorers import ExpectedAttentionScorer, KeyDiffScorer, KeyNormScorer, QueryStats, head_budgets


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
