"""The gated delta rule's two forms agree with each other and with transformers' torch fallbacks, from a zero and a
nonzero state, over lengths that do and do not fill the 64-token chunks; split runs continue exactly where one
run would; the causal conv continues from its tail."""
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kvserve.model.gated_delta import (causal_conv, chunked_gated_delta_rule, qk_norm_and_scale,
                                       recurrent_gated_delta_rule)

B, H, DK, DV = 2, 3, 16, 8


def inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, tokens, H, DK, generator=gen) for _ in range(2))
    v = torch.randn(B, tokens, H, DV, generator=gen)
    g = -torch.rand(B, tokens, H, generator=gen) * 2  # decays in log space, <= 0
    beta = torch.rand(B, tokens, H, generator=gen)
    state = torch.randn(B, H, DK, DV, generator=gen) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("tokens", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("zero_state", [True, False])
def test_chunked_and_recurrent_agree_with_transformers(tokens, zero_state):
    q, k, v, g, beta, state = inputs(tokens)
    if zero_state:
        state = torch.zeros_like(state)
    qn, kn = qk_norm_and_scale(q, k)
    chunked, chunked_state = chunked_gated_delta_rule(qn, kn, v, g, beta, state)
    recurrent, recurrent_state = recurrent_gated_delta_rule(qn, kn, v, g, beta, state)
    theirs, theirs_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs_rec, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (chunked - recurrent).abs().max() <= 1e-4
    assert (chunked_state - recurrent_state).abs().max() <= 1e-4
    assert (chunked - theirs).abs().max() <= 1e-4
    assert (chunked_state - theirs_state).abs().max() <= 1e-4
    assert (recurrent - theirs_rec).abs().max() <= 1e-4


@pytest.mark.parametrize("cut", [1, 30, 64, 70])
def test_a_split_run_continues_from_its_state(cut):
    q, k, v, g, beta, state = inputs(100, seed=1)
    q, k = qk_norm_and_scale(q, k)
    whole, whole_state = chunked_gated_delta_rule(q, k, v, g, beta, state)
    first, mid = chunked_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], state)
    rest, end = recurrent_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], mid)
    assert (torch.cat([first, rest], dim=1) - whole).abs().max() <= 1e-4
    assert (end - whole_state).abs().max() <= 1e-4


def test_causal_conv_continues_from_its_tail():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 20, generator=gen)
    weight = torch.randn(12, 4, generator=gen)
    zeros = torch.zeros(2, 12, 3)
    whole, whole_tail = causal_conv(x, zeros, weight)
    first, tail = causal_conv(x[..., :7], zeros, weight)
    second, end_tail = causal_conv(x[..., 7:8], tail, weight)  # one decode token
    third, end_tail = causal_conv(x[..., 8:], end_tail, weight)
    assert torch.allclose(torch.cat([first, second, third], dim=-1), whole, atol=1e-6)
    assert torch.equal(end_tail, whole_tail) and torch.equal(whole_tail, x[..., -3:])
    theirs = hf.causal_conv1d_fn(x, weight, None, activation="silu")
    assert torch.allclose(whole, theirs, atol=1e-6)
