"""Every sample of an n>1 request holds one of max_num_seqs slots, whatever the mix of n, prompts and preemptions;
and a request that arrives beside an n>1 job that preempts all the time completes within its stated bound
(docs/server.md, "How a request runs"): max_tokens steps for a prompt that fits one step's token budget."""
import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

MAX_NUM_SEQS = 6
POOL_BLOCKS = 12  # 192 tokens: a few sequences at a time, so the mixes below preempt
TOKEN_BYTES = 512  # the tiny model: 2 layers x 2 KV heads x 16 dims x 4 bytes x (K, V)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fairness"), "llama-gqa")


@pytest.fixture(scope="module")
def reference(model_dir):
    """A large pool: every request runs without preemption."""
    return LLM(str(model_dir), kv_cache_memory="4MiB", max_model_len=128)


def small_pool(model_dir, num_blocks: int = POOL_BLOCKS, **options) -> LLM:
    llm = LLM(str(model_dir), kv_cache_memory=num_blocks * 16 * TOKEN_BYTES, max_model_len=128,
              max_num_seqs=MAX_NUM_SEQS, **options)
    assert llm.engine.kv.pool.num_blocks == num_blocks
    return llm


def random_mix(seed: int) -> list[tuple[int, list[int], SamplingParams]]:
    """(step it arrives at, prompt, params) for 7 requests with n from 1 to max_num_seqs."""
    rng = random.Random(seed)
    mix = []
    for i in range(7):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(n=rng.randint(1, MAX_NUM_SEQS), temperature=1.0, seed=100 * seed + i,
                                max_tokens=rng.randint(1, 40), ignore_eos=True)
        mix.append((rng.randint(0, 30), prompt, params))
    return sorted(mix, key=lambda item: item[0])


def step_checked(engine, results: dict) -> None:
    """One step; the running sequences never exceed max_num_seqs, counted before and after it."""
    assert len(engine.scheduler.running) <= MAX_NUM_SEQS
    for output in engine.step():
        if output.finished:
            results[output.request_id] = [c.token_ids for c in output.outputs]
    assert len(engine.scheduler.running) <= MAX_NUM_SEQS


@pytest.mark.parametrize("seed", range(6))
def test_running_sequences_never_exceed_max_num_seqs(model_dir, reference, seed):
    llm = small_pool(model_dir)
    engine, mix, results, step = llm.engine, random_mix(seed), {}, 0
    pending = list(enumerate(mix))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        step_checked(engine, results)
        step += 1
    for i, (_, prompt, params) in enumerate(mix):  # preempted or not, each sample is what it is alone
        assert results[str(i)] == [c.token_ids for c in reference.generate(prompt, params)[0].outputs]
    assert engine.stats()["num_used_blocks"] == 0


def test_the_mixes_preempt_and_fill_every_slot(model_dir):
    """The mixes above exercise what they claim: preemption, and all max_num_seqs slots held at once."""
    preemptions, peak = 0, 0
    for seed in range(6):
        engine, results = small_pool(model_dir).engine, {}
        for i, (_, prompt, params) in enumerate(random_mix(seed)):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            step_checked(engine, results)
            peak = max(peak, len(engine.scheduler.running))
        preemptions += engine.stats()["num_preemptions"]
    assert preemptions > 0 and peak == MAX_NUM_SEQS


def test_n_above_the_free_slots_queues_the_rest_of_the_samples(model_dir, reference):
    llm = small_pool(model_dir, num_blocks=64)
    params = SamplingParams(n=MAX_NUM_SEQS, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    engine, results = llm.engine, {}
    engine.add_request("one", [5] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("many", [7] * 20, params)
    step_checked(engine, results)
    assert len(engine.scheduler.running) == MAX_NUM_SEQS  # "one", "many" and 4 of its 5 siblings
    assert engine.stats()["num_waiting"] == 1
    while engine.has_unfinished_requests():
        step_checked(engine, results)
    assert results["many"] == [c.token_ids for c in reference.generate([7] * 20, params)[0].outputs]


def test_a_small_request_completes_within_its_bound_beside_a_churning_n_job(model_dir, reference):
    """An n=max_num_seqs job on a pool that holds two of its samples preempts them as they grow; a request sent
    in the middle of it is admitted at once and finishes in max_tokens steps, its prompt fitting one step."""
    llm = small_pool(model_dir, num_blocks=16)  # a sample of the job takes 8 blocks, the small request 4
    engine, results = llm.engine, {}
    job = SamplingParams(n=MAX_NUM_SEQS, temperature=1.0, seed=3, max_tokens=100, ignore_eos=True)
    engine.add_request("job", [11] * 20, job)
    while engine.stats()["num_preemptions"] < 3:
        assert engine.has_unfinished_requests()
        step_checked(engine, results)
    small_prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    small = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("small", small_prompt, small)
    preemptions_before, steps = engine.stats()["num_preemptions"], 0
    while "small" not in results:
        step_checked(engine, results)
        steps += 1
    churn = engine.stats()["num_preemptions"] - preemptions_before
    assert steps <= small.max_tokens, f"the small request took {steps} steps"
    assert churn > 0  # the job went on preempting its samples meanwhile
    assert results["small"] == [reference.generate(small_prompt, small)[0].outputs[0].token_ids]
    while engine.has_unfinished_requests():
        step_checked(engine, results)
    assert results["job"] == [c.token_ids for c in reference.generate([11] * 20, job)[0].outputs]


def test_a_small_request_is_admitted_while_later_samples_recompute_whole_steps(model_dir, reference):
    """Without prefix caching a preempted sample recomputes its 100-token prompt, 32 tokens a step: the step's
    token budget is gone before admission. The small request still starts at once and finishes in max_tokens."""
    llm = small_pool(model_dir, num_blocks=12, max_num_batched_tokens=32, enable_prefix_caching=False)
    engine, results = llm.engine, {}
    job_prompt = torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    job = SamplingParams(n=MAX_NUM_SEQS, temperature=1.0, seed=8, max_tokens=20, ignore_eos=True)
    engine.add_request("job", job_prompt, job)

    def recomputing() -> bool:
        return any(s.index > 0 and s.num_uncomputed_tokens >= 32 for s in engine.scheduler.running)

    while not recomputing():
        assert engine.has_unfinished_requests(), "no sample of the job was recomputing"
        step_checked(engine, results)
    small = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("small", [9, 8, 7, 6], small)
    steps = 0
    while "small" not in results:
        step_checked(engine, results)
        steps += 1
    assert steps <= small.max_tokens, f"the small request took {steps} steps"
    assert results["small"] == [reference.generate([9, 8, 7, 6], small)[0].outputs[0].token_ids]
    while engine.has_unfinished_requests():
        step_checked(engine, results)
    assert results["job"] == [c.token_ids for c in reference.generate(job_prompt, job)[0].outputs]
