"""SamplingParams(n=4): the prompt is prefilled once, the four samples share its blocks and copy only the partly
filled last one on their first write, so together they hold the prompt's blocks once plus their own; each sample
is what n=1 gives with its seed, and every block is released at the end."""
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kv.kv_cache_manager import blocks_needed
from tests.conftest import make_tiny_model

BS = 16
PROMPT_LEN, MAX_TOKENS, N = 100, 40, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("parallel-sampling"), "llama-gqa")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()


def sampling(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def assert_refs_match_tables(llm: LLM) -> None:
    kv = llm.engine.kv
    holders = Counter(b for seq in llm.engine.scheduler.running for b in kv.block_ids(seq.request_id))
    assert {b.block_id: b.ref_cnt for b in kv.pool.blocks if b.ref_cnt} == dict(holders)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_the_prompt_blocks(model_dir, prompt, prefix_caching):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    engine.add_request("r", prompt, sampling(N, seed=100))
    used, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
        used.append(llm.stats()["num_used_blocks"])
        assert_refs_match_tables(llm)
    assert llm.stats()["num_prefill_tokens"] == PROMPT_LEN  # prefilled once, not n times

    shared = PROMPT_LEN // BS  # full prompt blocks: never copied
    own = blocks_needed(PROMPT_LEN + MAX_TOKENS - 1, BS) - shared  # the last sampled token never gets a slot
    assert used[0] == blocks_needed(PROMPT_LEN, BS)  # after the prefill step: the prompt's blocks, all shared
    assert used[1] == used[0] + N - 1  # first decode: all but one sample copy the shared partial block
    assert max(used) == shared + N * own < N * (shared + own)

    assert len(final.outputs) == N and final.finished
    for i, completion in enumerate(final.outputs):  # sample i draws with seed + i, whatever it shares
        alone = llm.generate(prompt, sampling(1, seed=100 + i))[0].outputs[0]
        assert completion.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in final.outputs}) == N
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert all(block.ref_cnt == 0 for block in engine.kv.pool.blocks)
