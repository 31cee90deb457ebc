"""Continuous batching must not change results: 16 prompts of different lengths, greedy, give token for token
what each gives alone — also when a tiny KV budget forces preemption and a small token budget forces chunked
prefill. Every block is back in the pool afterwards and no live request ever wastes a whole block."""
import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

PROMPT_LENS = [3, 7, 12, 16, 17, 25, 31, 33, 40, 48, 57, 64, 65, 80, 97, 120]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("batching"), "llama-gqa")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def alone(model_dir, prompts):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]


def run_checked(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Step the engine by hand to check slot waste of every live request after every step."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        for seq in engine.scheduler.running:
            waste = engine.kv.num_allocated_slots(seq.request_id) - seq.num_computed_tokens
            assert 0 <= waste <= engine.kv.block_size - 1
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert all(block.ref_cnt == 0 for block in engine.kv.pool.blocks)
    return [results[str(i)] for i in range(len(prompts))]


def test_batched_equals_alone(model_dir, prompts, alone):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256)
    assert run_checked(llm, prompts) == alone
    assert llm.stats()["num_preemptions"] == 0


def test_preemption_keeps_outputs(model_dir, prompts, alone):
    # 20 blocks of 16 tokens: one request of 144 tokens fits, the 16 together do not
    llm = LLM(str(model_dir), kv_cache_memory=20 * 16 * 512, max_model_len=256)
    assert llm.engine.kv.pool.num_blocks == 20
    assert run_checked(llm, prompts) == alone
    assert llm.stats()["num_preemptions"] > 0


def test_chunked_prefill_keeps_outputs(model_dir, prompts, alone):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256, max_num_batched_tokens=24)
    engine = llm.engine
    assert run_checked(llm, prompts) == alone
    assert engine.stats()["num_prefill_tokens"] == sum(PROMPT_LENS)


def test_max_num_seqs_bounds_the_batch(model_dir, prompts, alone):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256, max_num_seqs=3)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 3
