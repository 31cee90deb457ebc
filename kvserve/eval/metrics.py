"""Quality of a tested setting's next-token distributions against the reference's, position by position."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class QualityTotals:
    """Sums over scored positions; the reported numbers are their means."""

    tokens_scored: int = 0
    nll_sum: float = 0.0  # -log p(actual next token)
    kld_sum: float = 0.0  # KL(reference || tested)
    top1_agreements: int = 0

    def add(self, reference: torch.Tensor, tested: torch.Tensor, targets: torch.Tensor) -> None:
        """reference, tested: [n, vocab] log-probabilities of the same n positions; targets: [n] actual tokens."""
        self.tokens_scored += len(targets)
        self.nll_sum -= float(tested.gather(1, targets[:, None]).sum(dtype=torch.float64))
        # KL(P||Q) = sum p (log p - log q), as llama.cpp's --kl-divergence reports it; float64 for the sum
        self.kld_sum += float((reference.exp() * (reference - tested)).sum(dtype=torch.float64))
        self.top1_agreements += int((reference.argmax(dim=-1) == tested.argmax(dim=-1)).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.tokens_scored)

    @property
    def kld(self) -> float:
        return self.kld_sum / self.tokens_scored

    @property
    def top1_agreement(self) -> float:
        return self.top1_agreements / self.tokens_scored
