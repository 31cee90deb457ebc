"""Sampling: greedy is argmax, filters (top-k, top-p, min-p) only remove unlikely tokens, penalties push the
distribution the documented way, logprobs are true log-probabilities, and a per-request seed gives the same
tokens whether the request runs alone or batched with others, each token drawn by its (seed, position) alone."""
import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine import sampler
from kvserve.engine.sampler import sample
from kvserve.engine.sequence import Sequence
from tests.conftest import make_tiny_model

VOCAB = 20


def make_seq(params: SamplingParams, prompt=(0,), output=(), seed: int | None = None) -> Sequence:
    return Sequence(
        request_id="r", index=0, token_ids=list(prompt) + list(output), num_prompt_tokens=len(prompt),
        params=params, eos_token_ids=frozenset(), max_tokens=100, detokenizer=Detokenizer(None),
        seed=seed,
    )


def draw(logits: list[float], params: SamplingParams, times: int = 400) -> list[int]:
    """`times` samples of one row of logits, as one batch sharing the default generator."""
    rows = torch.tensor([logits] * times)
    return sample(rows, [make_seq(params) for _ in range(times)], torch.Generator().manual_seed(0)).token_ids


def greedy_pick(logits: list[float], prompt=(0,), output=(), **params) -> int:
    seq = make_seq(SamplingParams(temperature=0, **params), prompt, output)
    return sample(torch.tensor([logits]), [seq], torch.Generator()).token_ids[0]


# Four likely tokens with probabilities 0.5, 0.3, 0.15, 0.05 (and nothing else).
FOUR = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]


def test_greedy_is_argmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [make_seq(SamplingParams(temperature=0)) for _ in range(5)]
    assert sample(logits, seqs, torch.Generator()).token_ids == logits.argmax(dim=-1).tolist()
    # a tie goes to the first of the largest, as argmax's does, in rows long enough to be split up
    tied = torch.zeros(3, 300_000)
    tied[:, [7, 123_456, 299_999]] = 1.0
    tied[1, 5] = 1.0
    seqs = [make_seq(SamplingParams(temperature=0)) for _ in range(3)]
    assert sample(tied, seqs, torch.Generator()).token_ids == [7, 5, 7]


def test_unfiltered_sampling_draws_in_proportion():
    counts = torch.bincount(torch.tensor(draw(FOUR, SamplingParams(temperature=1.0), times=4000)), minlength=4)
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.5, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
], ids=["top_k=1", "tiny top_p", "min_p=1"])
def test_filters_that_keep_one_token_equal_greedy(params):
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(1))
    seqs = [make_seq(params, seed=i) for i in range(64)]
    assert sample(logits, seqs, torch.Generator()).token_ids == logits.argmax(dim=-1).tolist()
    # a tie goes to the first of the largest, as argmax's does, in rows long enough to be split up
    tied = torch.zeros(3, 300_000)
    tied[:, [7, 123_456, 299_999]] = 1.0
    tied[1, 5] = 1.0
    seqs = [make_seq(SamplingParams(temperature=0)) for _ in range(3)]
    assert sample(tied, seqs, torch.Generator()).token_ids == [7, 5, 7]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 alone is under 0.7, 0.5 + 0.3 reaches it
    (SamplingParams(top_p=0.85), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),  # keeps p >= 0.5 * 0.5
    (SamplingParams(min_p=0.2), {0, 1, 2}),  # drops 0.05 < 0.1
])
def test_filters_keep_exactly_the_likely_tokens(params, allowed):
    assert set(draw(FOUR, params)) == allowed


@pytest.mark.parametrize("temperature", [0.3, 2.0])
def test_temperature_divides_the_logits(temperature):
    share_of_top = draw(FOUR, SamplingParams(temperature=temperature), times=2000).count(0) / 2000
    expected = torch.softmax(torch.tensor(FOUR) / temperature, dim=0)[0].item()  # 0.83 at 0.3, 0.38 at 2.0
    assert share_of_top == pytest.approx(expected, abs=0.04)


def test_repetition_penalty_shrinks_seen_tokens_toward_zero():
    # positive logit: divided; negative logit: multiplied; both make a seen token less likely
    assert greedy_pick([2.0, 1.9, 0.0], prompt=[0]) == 0
    assert greedy_pick([2.0, 1.9, 0.0], repetition_penalty=1.2, prompt=[0]) == 1
    assert greedy_pick([-1.0, -1.1, -5.0], repetition_penalty=1.2, prompt=[0]) == 1
    assert greedy_pick([2.0, 1.9, 0.0], repetition_penalty=1.2, prompt=[2], output=[0]) == 1
    assert greedy_pick([2.0, 2.1, 0.0], repetition_penalty=0.8, prompt=[0]) == 0  # < 1 encourages


def test_presence_penalty_counts_generated_tokens_once():
    assert greedy_pick([1.0, 0.8], presence_penalty=0.5, prompt=[1], output=[0]) == 1
    assert greedy_pick([1.0, 0.8], presence_penalty=0.5, prompt=[0], output=[1]) == 0  # prompt is free
    assert greedy_pick([1.0, 0.8], presence_penalty=-0.5, output=[1]) == 1  # negative encourages
    assert greedy_pick([1.0, 0.9, 0.0], presence_penalty=0.15, output=[0, 0, 0, 1]) == 0


def test_frequency_penalty_grows_with_the_count():
    # token 0 generated 3 times, token 1 once: 1.0 - 3 * 0.1 = 0.7 < 0.9 - 0.1 = 0.8
    assert greedy_pick([1.0, 0.9, 0.0], frequency_penalty=0.1, output=[0, 0, 0, 1]) == 1
    assert greedy_pick([1.0, 0.9, 0.0], frequency_penalty=0.1, prompt=[0, 0, 0], output=[2]) == 0


def test_penalties_shift_sampled_distribution_away_from_repeats():
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    seqs = [make_seq(params, output=[0, 0]) for _ in range(400)]
    tokens = sample(torch.tensor([FOUR] * 400), seqs, torch.Generator().manual_seed(0)).token_ids
    assert tokens.count(0) < 0.1 * 400  # 0.5 * e^-4 against the others: ~3%


def test_logprobs_are_log_probabilities_of_the_raw_row():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    raw = torch.log_softmax(logits[0], dim=-1)
    result = sample(logits, [make_seq(SamplingParams(temperature=1.0, logprobs=VOCAB), seed=0)], torch.Generator())
    top = result.top_logprobs[0]
    token = result.token_ids[0]
    assert len(top) == VOCAB
    assert all(value <= 0 for value in top.values())
    assert torch.logsumexp(torch.tensor(list(top.values())), dim=0).item() == pytest.approx(0.0, abs=1e-5)
    assert top[token] == pytest.approx(raw[token].item()) == pytest.approx(result.logprobs[0])


def test_logprobs_hold_the_top_k_plus_the_sampled_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    raw = torch.log_softmax(logits[0], dim=-1)
    # the repetition penalty makes greedy pick token 1, which is not the raw top-1
    seq = make_seq(SamplingParams(temperature=0, repetition_penalty=10.0, logprobs=1), prompt=[0])
    result = sample(logits, [seq], torch.Generator())
    assert result.token_ids == [1]
    assert result.top_logprobs[0] == pytest.approx({0: raw[0].item(), 1: raw[1].item()})
    assert result.logprobs[0] == pytest.approx(raw[1].item())  # under the raw distribution, not the penalized one

    seq = make_seq(SamplingParams(temperature=0, logprobs=2))
    assert sample(logits, [seq], torch.Generator()).top_logprobs[0] == pytest.approx({0: raw[0].item(),
                                                                                      1: raw[1].item()})
    seq = make_seq(SamplingParams(temperature=0, logprobs=0))
    assert sample(logits, [seq], torch.Generator()).top_logprobs[0] == pytest.approx({0: raw[0].item()})
    assert sample(logits, [make_seq(SamplingParams(temperature=0))], torch.Generator()).top_logprobs == [None]


@pytest.mark.parametrize("rows_at_a_time", [1, 3, 64])
def test_a_batch_gets_each_rows_logprobs_whatever_rows_are_taken_at_a_time(monkeypatch, rows_at_a_time):
    """Log-probabilities are computed a few rows at a time (a large vocabulary's whole batch would not fit the kept
    heap): every row gets its own, a penalized row's under its raw distribution, in the batch's order."""
    monkeypatch.setattr(sampler, "LOGPROB_ROWS_BYTES", rows_at_a_time * VOCAB * 4)
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    raw = torch.log_softmax(logits, dim=-1)
    seqs = [make_seq(SamplingParams(temperature=0, logprobs=2 if i % 2 else None,
                                    repetition_penalty=50.0 if i == 3 else 1.0), prompt=[int(raw[i].argmax())])
            for i in range(7)]
    result = sample(logits, seqs, torch.Generator())
    assert result.token_ids[3] != int(raw[3].argmax())  # the penalty moved row 3's pick off its raw top-1
    assert result.logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(result.token_ids)], abs=1e-6)
    for i, top in enumerate(result.top_logprobs):
        if i % 2 == 0:
            assert top is None
        else:
            best = raw[i].topk(2).indices.tolist()
            assert top == pytest.approx({t: raw[i, t].item() for t in best + [result.token_ids[i]]}, abs=1e-6)


# ---- seeds through the engine ------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sampler"), "llama-gqa")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=128)


def others() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[5, 6, 7], list(range(10, 40)), [9] * 17, [3, 4]]
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=99, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1234, top_k=5, max_tokens=9, ignore_eos=True)]
    return prompts, params


def test_a_seeded_draw_depends_on_its_seed_and_position_alone():
    """The same seed and output position draw the same token, whatever was drawn before and beside it; another
    position or seed draws afresh; the shared generator is left as it was."""
    uniform = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0)
    shared = torch.Generator().manual_seed(0)
    before = shared.get_state()

    def pick(seed, output):
        return sample(uniform, [make_seq(params, output=output, seed=seed)], shared).token_ids[0]

    first = pick(7, [1, 2, 3])
    assert [pick(7, [9, 9, 9]) for _ in range(3)] == [first] * 3  # the position, not the tokens, keys it
    assert len({pick(7, [1] * i) for i in range(8)}) > 4  # positions 0..7: fresh draws from 1,000 tokens
    assert len({pick(seed, [1, 2, 3]) for seed in range(8)}) > 4
    assert torch.equal(shared.get_state(), before)
    # beside unseeded rows, which draw from the shared generator
    batch = [make_seq(params), make_seq(params, output=[5, 5, 5], seed=7), make_seq(params)]
    assert sample(uniform.expand(3, -1), batch, shared).token_ids[1] == first


def test_seeded_request_gives_the_same_tokens_alone_and_batched(llm):
    prompt = [11, 22, 33, 44, 55]
    alone = llm.generate(prompt, SEEDED)[0].outputs[0].token_ids
    assert llm.generate(prompt, SEEDED)[0].outputs[0].token_ids == alone
    prompts, params = others()
    batched = llm.generate(prompts[:2] + [prompt] + prompts[2:], params[:2] + [SEEDED] + params[2:])
    assert batched[2].outputs[0].token_ids == alone


def test_different_seeds_give_different_tokens(llm):
    prompt = [11, 22, 33, 44, 55]
    outputs = {
        tuple(llm.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True))
              [0].outputs[0].token_ids)
        for seed in (1, 2, 3)
    }
    assert len(outputs) == 3


def test_seeded_request_is_unchanged_by_preemption(model_dir, llm):
    prompt = [11, 22, 33, 44, 55]
    alone = llm.generate(prompt, SEEDED)[0].outputs[0].token_ids
    small = LLM(str(model_dir), kv_cache_memory=3 * 16 * 512, max_model_len=48)  # 3 blocks for 4 requests
    crowd = [list(range(20, 40)), list(range(50, 64)), list(range(70, 80))]
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    outputs = small.generate([prompt] + crowd, [SEEDED] + params)
    assert small.stats()["num_preemptions"] > 0
    assert outputs[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("option", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "tiny top_p"])
def test_one_token_filters_equal_greedy_through_the_engine(llm, option):
    prompts = [[11, 22, 33, 44, 55], list(range(60, 90))]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    filtered = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, **option))
    assert [o.outputs[0].token_ids for o in filtered] == [o.outputs[0].token_ids for o in greedy]
