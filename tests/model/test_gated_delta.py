"""The gated delta rule's two forms agree with each other and with transformers' torch fallbacks, from a zero and a
nonzero state, over lengths that do and do not fill the 64-token chunks; split runs continue exactly where one run
would; sequences of different lengths padded into one call agree with each run alone; the in-place forms agree with
the copying ones (the chunked one leaving its final state in the caller's copy); the causal conv continues from its
tail."""
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kvserve.model.gated_delta import (causal_conv, chunked_gated_delta_rule, conv_step_, qk_norm_and_scale,
                                       recurrent_gated_delta_rule, recurrent_gated_delta_rule_)

B, H, DK, DV = 2, 3, 16, 8


def inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, tokens, H, DK, generator=gen) for _ in range(2))
    v = torch.randn(B, tokens, H, DV, generator=gen)
    g = -torch.rand(B, tokens, H, generator=gen) * 2  # decays in log space, <= 0
    beta = torch.rand(B, tokens, H, generator=gen)
    state = torch.randn(B, H, DV, DK, generator=gen) * 0.5  # as the state cache holds it: transformers' transposed
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
    theirs, theirs_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state.transpose(-1, -2),
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs_rec, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.transpose(-1, -2),
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs_state = theirs_state.transpose(-1, -2)
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
    zeros = torch.zeros(2, 3, 12)  # tails [B, K - 1, C]
    whole, whole_tail = causal_conv(x, zeros, weight)
    first, tail = causal_conv(x[..., :7], zeros, weight)
    second, end_tail = causal_conv(x[..., 7:8], tail, weight)  # one decode token
    third, end_tail = causal_conv(x[..., 8:], end_tail, weight)
    assert torch.allclose(torch.cat([first, second, third], dim=-1), whole, atol=1e-6)
    assert torch.equal(end_tail, whole_tail) and torch.equal(whole_tail, x[..., -3:].transpose(1, 2))
    theirs = hf.causal_conv1d_fn(x, weight, None, activation="silu")
    assert torch.allclose(whole, theirs, atol=1e-6)


@pytest.mark.parametrize("lengths", [[130, 5, 64, 70], [3, 3], [1, 64, 65]])
def test_sequences_of_different_lengths_in_one_call_agree_with_each_alone(lengths):
    q, k, v, g, beta, state = (torch.cat(x) for x in zip(*(inputs(max(lengths), seed=s)
                                                           for s in range(len(lengths) // 2 + 1))))
    q, k, v, g, beta, state = (x[: len(lengths)] for x in (q, k, v, g, beta, state))
    q, k = qk_norm_and_scale(q, k)
    kept = state.clone()
    together, together_state = chunked_gated_delta_rule(q, k, v, g, beta, state, lengths=torch.tensor(lengths))
    assert torch.equal(state, kept)  # the caller's states are kept
    for i, n in enumerate(lengths):
        alone, alone_state = chunked_gated_delta_rule(*(x[i : i + 1, :n] for x in (q, k, v, g, beta)),
                                                      state[i : i + 1])
        assert (together[i : i + 1, :n] - alone).abs().max() <= 1e-5
        assert (together_state[i : i + 1] - alone_state).abs().max() <= 1e-5
        assert not together[i, -(-n // 64) * 64 :].any()  # blocks past a sequence's end are not computed


@pytest.mark.parametrize("lengths", [None, [130, 5], [64, 1]])
def test_prompts_that_start_their_sequences_read_no_state_and_equal_a_zero_one(lengths):
    """A round whose pieces all start their sequences passes no state: the first block reads none and makes the
    state new; outputs and final states are a zero state's."""
    q, k, v, g, beta, state = inputs(130, seed=6)
    q, k = qk_norm_and_scale(q, k)
    lengths = None if lengths is None else torch.tensor(lengths)
    zeros = chunked_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(state), lengths=lengths)
    none = chunked_gated_delta_rule(q, k, v, g, beta, None, lengths=lengths)
    assert (none[0] - zeros[0]).abs().max() <= 1e-6 and (none[1] - zeros[1]).abs().max() <= 1e-6
    assert none[1].any()


def test_the_in_place_recurrent_rule_updates_the_state_it_is_given():
    q, k, v, g, beta, state = inputs(3, seed=3)
    q, k = qk_norm_and_scale(q, k)
    out, new_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    in_place = state.clone()
    assert (recurrent_gated_delta_rule_(q, k, v, g, beta, in_place) - out).abs().max() <= 1e-6
    assert (in_place - new_state).abs().max() <= 1e-6
    assert not torch.equal(in_place, state)


@pytest.mark.parametrize("lengths", [None, [130, 5], [64, 70]])
def test_the_in_place_chunked_rule_leaves_the_final_state_in_the_state_it_is_given(lengths):
    q, k, v, g, beta, state = inputs(130, seed=4)
    q, k = qk_norm_and_scale(q, k)
    lengths = None if lengths is None else torch.tensor(lengths)
    out, new_state = chunked_gated_delta_rule(q, k, v, g, beta, state, lengths=lengths)
    given = state.clone()
    in_place_out, returned = chunked_gated_delta_rule(q, k, v, g, beta, given, lengths=lengths, in_place=True)
    assert returned is given
    assert torch.equal(in_place_out, out) and torch.equal(given, new_state)
    strided = state.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, heads outermost in memory
    assert all(torch.equal(a, b) for a, b in zip(chunked_gated_delta_rule(q, k, v, g, beta, strided, lengths=lengths),
                                                 (out, new_state)))


def test_padded_conv_and_the_one_token_step_continue_like_the_plain_conv():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 9, generator=gen)
    weight = torch.randn(12, 4, generator=gen)
    tails = torch.randn(2, 3, 12, generator=gen)
    padded, padded_tails = causal_conv(x, tails, weight, lengths=torch.tensor([9, 5]))
    for i, n in enumerate([9, 5]):
        alone, alone_tail = causal_conv(x[i : i + 1, :, :n], tails[i : i + 1], weight)
        assert torch.allclose(padded[i : i + 1, :, :n], alone, atol=1e-6)
        assert torch.equal(padded_tails[i : i + 1], alone_tail)
    step_tails = tails.clone()
    step = conv_step_(x[..., 0], step_tails, weight.T.contiguous())
    whole, whole_tail = causal_conv(x[..., :1], tails, weight)
    assert torch.allclose(step, whole[..., 0], atol=1e-6) and torch.equal(step_tails, whole_tail)
