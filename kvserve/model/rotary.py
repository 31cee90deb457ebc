"""Rotary position embeddings (HF's rotate-half layout), with linear, llama3 and YaRN frequency scaling."""
from __future__ import annotations

import math
from typing import Any

import torch



def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_scaled(inv_freq, head_dim, theta, scaling)
    return _llama3_scaled(inv_freq, scaling)


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    # YaRN: dims that turn many times within the original length keep their frequency, dims that turn less than
    # once are divided by `factor`, with a linear ramp between the two (the bounds floored and ceiled unless
    # truncate is false).
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over the original length
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_scaled(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to `max_positions`, looked up per token; both multiplied by
    `attention_factor` (YaRN scales the rotated parts of queries and keys so)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: str | torch.device = "cpu", attention_factor: float = 1.0):
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.attention_factor = attention_factor
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * attention_factor).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [T, 1, head_dim], ready to broadcast over heads. Positions past the table (a streaming
        sequence grows without end) are computed on the spot, in float64 so large angles stay exact."""
        # (the compiled decode step never sees such positions: compile/steps.py leaves unbounded streams eager)
        if not torch.compiler.is_compiling() and len(positions) and int(positions.max()) >= len(self.cos):
            freqs = positions.double()[:, None].cpu() * self.inv_freq.double()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.attention_factor).to(dtype=self.cos.dtype, device=self.cos.device)
            sin = (emb.sin() * self.attention_factor).to(dtype=self.sin.dtype, device=self.sin.device)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
