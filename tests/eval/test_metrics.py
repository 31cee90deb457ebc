"""Perplexity, KLD and top-1 agreement as llama.cpp reports them, from log-probability rows."""
import math

import pytest
import torch

from kvserve.eval.metrics import QualityTotals


def test_identical_distributions_give_zero_kld_and_full_agreement():
    rows = torch.randn(10, 50).log_softmax(-1)
    targets = torch.randint(0, 50, (10,))
    totals = QualityTotals()
    totals.add(rows, rows, targets)
    assert totals.kld == 0 and totals.top1_agreement == 1
    assert totals.ppl == pytest.approx(math.exp(-float(rows[torch.arange(10), targets].mean())))


def test_kld_is_reference_weighted_and_agreement_counts_argmax_changes():
    reference = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]).log()
    tested = torch.tensor([[0.4, 0.5, 0.1], [0.1, 0.1, 0.8]]).log()
    totals = QualityTotals()
    totals.add(reference, tested, torch.tensor([0, 2]))
    p = torch.tensor([0.7, 0.2, 0.1])
    expected = float((p * (p.log() - torch.tensor([0.4, 0.5, 0.1]).log())).sum()) / 2
    assert totals.kld == pytest.approx(expected) and totals.top1_agreement == 0.5
    assert totals.tokens_scored == 2
