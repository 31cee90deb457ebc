"""Speculative decoding on hybrid models (Gated DeltaNet layers beside full attention): the linear layers' state
rolls back to the last accepted token (kv/draft_states.py), so greedy output with speculation (ngram and suffix)
is the output without it, for the Qwen3-Next and Qwen3.5 layouts, with n = 2, under preemption and without
prefix caching, and each token's top logprobs (both samples of n = 2) are transformers' within 1e-4; checkpoints saved in verification steps hold the state at their block boundary, and the next turn
resumes from them; aborts mid-speculation leave no block or state slot held.

The tiny models here have a 32-token vocabulary and small weights: their greedy text falls into loops that vary
now and then, so prompt lookup drafts both tokens the model goes on to produce and tokens it does not."""
import pytest
import torch
import transformers

from kvserve import LLM, EngineConfig, LLMEngine, SamplingParams
from kvserve.kv.block_hash import hash_full_blocks
from kvserve.kv.draft_states import DraftStates
from tests.model.test_qwen3_next import TOLERANCE as LOGIT_TOLERANCE
from tests.model.test_qwen3_next import assert_nothing_held, make_hybrid_model

VOCAB = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
# a checkpoint saved while verifying against one a plain prefill saves: the same math through other kernels (decode
# steps' recurrent form and few-row matmuls against one long chunk), so they differ in the last bits
TOLERANCE = 1e-5
OPTIONS = dict(kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def looping_model(request, tmp_path_factory):
    return make_hybrid_model(tmp_path_factory.mktemp(request.param), request.param, vocab_size=VOCAB,
                             initializer_range=0.02)


def prompts(num: int, length: int = 20) -> list[dict]:
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
             .tolist()} for seed in range(num)]


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def run_both(path, requests, params=GREEDY, speculation=NGRAM, **options) -> tuple[list, list, LLM]:
    """Outputs without speculation, then with it; and the speculating LLM."""
    expected = LLM(str(path), **{**OPTIONS, **options}).generate(requests, params)
    spec = LLM(str(path), **{**OPTIONS, **options}, speculative_config=speculation)
    return expected, spec.generate(requests, params), spec


def assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("speculation", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_output_is_the_same_with_speculation(looping_model, speculation):
    expected, got, spec = run_both(looping_model, prompts(4), speculation=speculation)
    assert token_ids(got) == token_ids(expected)
    assert_drafts_accepted_and_rejected(spec)
    assert_nothing_held(spec.engine)


def test_two_samples_each_speculate_from_their_own_state(looping_model):
    params = SamplingParams(n=2, max_tokens=60, temperature=0, ignore_eos=True)
    expected, got, spec = run_both(looping_model, prompts(2), params)
    assert token_ids(got) == token_ids(expected)
    assert all(len(o.outputs) == 2 for o in got)
    assert_drafts_accepted_and_rejected(spec)
    assert_nothing_held(spec.engine)


def test_without_prefix_caching_only_the_slot_rolls_back(looping_model):
    expected, got, spec = run_both(looping_model, prompts(2), enable_prefix_caching=False)
    assert spec.engine.kv.checkpoints is None
    assert token_ids(got) == token_ids(expected)
    assert_drafts_accepted_and_rejected(spec)
    assert_nothing_held(spec.engine)


def test_preemption_mid_speculation(looping_model):
    plan = LLM(str(looping_model), **OPTIONS).engine.cache_plan
    # 16 blocks beside 4 state slots: 4 sequences growing to 120 tokens need 32, so some are preempted
    small = plan.state.total_bytes + 16 * plan.block_bytes
    expected, got, spec = run_both(looping_model, prompts(4), kv_cache_memory=small)
    assert spec.engine.cache_plan.num_blocks == 16
    assert token_ids(got) == token_ids(expected)
    assert spec.stats()["num_preemptions"] > 0
    assert_drafts_accepted_and_rejected(spec)
    assert_nothing_held(spec.engine)


def transformers_logprobs(path, prompt: list[int], num_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' greedy continuation of `prompt` (float32) and the log-probabilities each of its tokens was
    picked from, [num_tokens, vocab]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = hf(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits, dim=-1), tokens[len(prompt) :]


@pytest.mark.parametrize("speculation", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_speculated_and_forked_tokens_have_transformers_logprobs(looping_model, speculation):
    """Every token of both samples (n = 2) of a speculating engine, accepted draft or not, against transformers
    run token by token: the same greedy tokens, and each step's top logprobs (the sampled token's and the four
    others most likely) within the logits' tolerance."""
    spec = LLM(str(looping_model), **OPTIONS, speculative_config=speculation)
    params = SamplingParams(n=2, max_tokens=30, temperature=0, ignore_eos=True, logprobs=4)
    requests = prompts(2)
    for request, output in zip(requests, spec.generate(requests, params)):
        expected, tokens = transformers_logprobs(looping_model, request["prompt_token_ids"], params.max_tokens)
        assert len(output.outputs) == 2
        for sample in output.outputs:
            assert sample.token_ids == tokens
            assert len(sample.logprobs) == len(tokens)
            for step, top in enumerate(sample.logprobs):
                assert len(top) >= 4
                for token, logprob in top.items():
                    assert abs(logprob - float(expected[step, token])) <= LOGIT_TOLERANCE, (step, token)
    assert_drafts_accepted_and_rejected(spec)
    assert_nothing_held(spec.engine)


def checkpoint_state(engine: LLMEngine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv tails and recurrent states (every linear layer) of the checkpoint saved after `tokens`."""
    key = hash_full_blocks(tokens, engine.kv.block_size, namespace=engine.kv.hash_namespace)[-1]
    slot = engine.kv.checkpoints.lookup(key)
    cache = engine.runner.state_cache
    return cache.conv[:, slot].clone(), cache.recurrent[:, slot].clone()


def test_checkpoints_saved_while_verifying_hold_the_state_at_their_boundary(looping_model, monkeypatch):
    saved = []  # (boundary, tokens the step kept past it, conv, recurrent) of each checkpoint a verification wrote
    keep = DraftStates.keep

    def recording_keep(self, request_id, num_tokens, into=None):
        keep(self, request_id, num_tokens, into)
        if into is None:
            self.num_kept = num_tokens
        else:
            saved.append((self.start(request_id) + num_tokens, self.num_kept - num_tokens,
                          self.conv[:, into].clone(), self.recurrent[:, into].clone()))

    monkeypatch.setattr(DraftStates, "keep", recording_keep)
    spec = LLM(str(looping_model), **OPTIONS, speculative_config=NGRAM)
    first = prompts(1)[0]["prompt_token_ids"]
    turn1 = spec.generate({"prompt_token_ids": first}, GREEDY)[0]
    assert any(past > 0 for _, past, _, _ in saved)  # a draft accepted past a boundary: the slot's state is not it
    # each against the checkpoint a plain engine saves at the same boundary of a prompt that ends one token later
    text = first + turn1.outputs[0].token_ids
    plain = LLMEngine(EngineConfig(model=str(looping_model), **OPTIONS))
    for boundary, _, conv, recurrent in saved:
        plain.add_request(str(boundary), {"prompt_token_ids": text[: boundary + 1]}, SamplingParams(max_tokens=1))
        while plain.has_unfinished_requests():
            plain.step()
        expected_conv, expected_recurrent = checkpoint_state(plain, text[:boundary])
        assert (conv - expected_conv).abs().max() <= TOLERANCE, boundary
        assert (recurrent - expected_recurrent).abs().max() <= TOLERANCE, boundary
    # the next turn resumes at the end of the first turn's last full block (its last token was never computed)
    second = text + prompts(2, length=7)[1]["prompt_token_ids"]
    turn2 = spec.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == (len(text) - 1) // 16 * 16
    no_cache = LLM(str(looping_model), **OPTIONS, enable_prefix_caching=False)
    assert turn2.outputs[0].token_ids == no_cache.generate({"prompt_token_ids": second}, GREEDY)[0].outputs[0].token_ids
    assert_nothing_held(spec.engine)


def test_aborts_mid_speculation_give_back_blocks_and_slots(looping_model):
    engine = LLMEngine(EngineConfig(model=str(looping_model), **OPTIONS, speculative_config=NGRAM))
    for i, request in enumerate(prompts(3)):
        engine.add_request(f"r{i}", request, GREEDY)
    while engine.speculator.stats.num_drafts < 3:  # verified drafts, their states kept for the rollback
        engine.step()
    engine.abort_request("r0")
    engine.step()  # the others go on, drafting
    for i in range(1, 3):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    assert_nothing_held(engine)
