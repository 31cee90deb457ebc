"""Prefix caching seen from the engine: a 10-turn conversation prefills only what is new each turn and gives the
same tokens as without the cache; a changed first token or another cache_salt gets no hits; a small pool evicts
cached blocks least recently used first, a request's tail before its head, and never a block a live request
holds; afterwards every block is free (cached or not)."""
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kv.block_hash import hash_full_blocks
from tests.conftest import make_tiny_model

BS = 16
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny llama-gqa: layers * (K, V) * kv heads * head dim * fp32
FIRST, QUESTION, ANSWER, TURNS = 1200, 200, 500, 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the 2-layer, hidden-64 model spends its time in op overhead: one thread is several times faster on a
    # shared box than threads competing for its cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefix-caching"), "llama-gqa", max_position_embeddings=8192)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiny_llm(model_dir, num_blocks: int | None = None, **options) -> LLM:
    memory = num_blocks * BS * BYTES_PER_TOKEN if num_blocks else "1MiB"
    max_model_len = num_blocks * BS if num_blocks else 1024  # the planner wants one full-length request to fit
    llm = LLM(str(model_dir), kv_cache_memory=memory, max_model_len=max_model_len, **options)
    assert num_blocks is None or llm.engine.kv.pool.num_blocks == num_blocks
    return llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def cached_tokens(llm: LLM, prompt, max_tokens: int = 1) -> int:
    return llm.generate(prompt, greedy(max_tokens))[0].num_cached_tokens


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert all(block.ref_cnt == 0 for block in llm.engine.kv.pool.blocks)


def test_conversation_prefills_only_the_new_turn_and_keeps_outputs(model_dir):
    questions = [tokens(FIRST, 0)] + [tokens(QUESTION, turn) for turn in range(1, TURNS)]
    llm = LLM(str(model_dir), kv_cache_memory="8MiB", max_model_len=8192)
    prompts, answers, prefilled, hits = [], [], [], []
    history: list[int] = []
    for question in questions:
        prompt = history + question
        before = llm.stats()["num_prefill_tokens"]
        out = llm.generate(prompt, greedy(ANSWER))[0]
        prefilled.append(llm.stats()["num_prefill_tokens"] - before)
        hits.append(out.num_cached_tokens)
        prompts.append(prompt)
        answers.append(out.outputs[0].token_ids)
        history = prompt + out.outputs[0].token_ids
    assert [len(p) for p in prompts] == [FIRST + turn * (QUESTION + ANSWER) for turn in range(TURNS)]
    for turn in range(1, TURNS):
        # every full block of the last turn is reused, answer included (its last token was never computed)
        previous_computed = len(prompts[turn - 1]) + ANSWER - 1
        assert hits[turn] == previous_computed // BS * BS
        assert prefilled[turn] == len(prompts[turn]) - hits[turn] <= QUESTION + BS
    assert sum(prefilled) <= FIRST + (TURNS - 1) * QUESTION + TURNS * BS
    assert_all_blocks_free(llm)

    # Without the cache: the same ten prompts. Submitted together, as by induction they are what a turn-by-turn
    # run would send if its answers equal the cached run's (batching is covered by test_batch_invariance).
    no_cache = LLM(str(model_dir), kv_cache_memory="32MiB", max_model_len=8192, enable_prefix_caching=False)
    outputs = no_cache.generate(prompts, greedy(ANSWER))
    assert no_cache.stats()["num_prefill_tokens"] == sum(map(len, prompts)) == 43_500
    assert no_cache.stats()["prefix_cache_hits"] == 0 and no_cache.stats()["num_cached_blocks"] == 0
    assert [o.outputs[0].token_ids for o in outputs] == answers


def test_changed_first_token_gets_no_hits(model_dir):
    llm = tiny_llm(model_dir)
    prompt = tokens(100, 1)
    assert cached_tokens(llm, prompt) == 0
    assert cached_tokens(llm, [prompt[0] + 1] + prompt[1:]) == 0  # e.g. a timestamp in the system prompt
    assert cached_tokens(llm, prompt) == 96  # 6 full blocks; the last prompt token is always computed


def test_reset_prefix_cache_makes_the_next_run_compute_its_prompt(model_dir):
    llm = tiny_llm(model_dir)
    prompt = tokens(100, 7)
    first = llm.generate(prompt, greedy(4))[0]
    assert cached_tokens(llm, prompt) == 96
    assert llm.reset_prefix_cache()
    again = llm.generate(prompt, greedy(4))[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_cache_salt_separates_users(model_dir):
    llm = tiny_llm(model_dir)
    prompt = tokens(100, 2)
    assert cached_tokens(llm, {"prompt_token_ids": prompt, "cache_salt": "alice"}) == 0
    assert cached_tokens(llm, {"prompt_token_ids": prompt, "cache_salt": "bob"}) == 0
    assert cached_tokens(llm, prompt) == 0
    assert cached_tokens(llm, {"prompt_token_ids": prompt, "cache_salt": "alice"}) == 96


def test_prefix_caching_can_be_switched_off(model_dir):
    llm = tiny_llm(model_dir, enable_prefix_caching=False)
    prompt = tokens(100, 3)
    assert cached_tokens(llm, prompt) == 0
    assert cached_tokens(llm, prompt) == 0
    assert llm.stats()["num_cached_blocks"] == 0 and llm.stats()["prefix_cache_hits"] == 0


def test_least_recently_used_prefix_is_evicted_first(model_dir):
    # 12 blocks; each 64-token prompt fills 4 (max_tokens=1: the sampled token never needs a slot)
    llm = tiny_llm(model_dir, num_blocks=12)
    a, b, c, d = (tokens(64, seed) for seed in (10, 11, 12, 13))
    for prompt in (a, b, c):
        assert cached_tokens(llm, prompt) == 0
    assert llm.stats()["num_cached_blocks"] == 12
    assert cached_tokens(llm, a) == 48  # a is now the most recently used
    assert cached_tokens(llm, d) == 0  # takes the 4 least recently used blocks: all of b's
    assert cached_tokens(llm, c) == 48
    assert cached_tokens(llm, a) == 48
    assert cached_tokens(llm, b) == 0
    assert_all_blocks_free(llm)


def test_a_request_tail_is_evicted_before_its_head(model_dir):
    llm = tiny_llm(model_dir, num_blocks=8)
    a = tokens(64, 20)
    cached_tokens(llm, a)
    cached_tokens(llm, tokens(96, 21))  # 6 blocks: the 4 never used, then a's last 2
    assert cached_tokens(llm, a) == 32  # a's first 2 blocks survived
    assert_all_blocks_free(llm)


def check_live_blocks(llm: LLM) -> None:
    """Every block's ref count is the number of live block tables holding it, and a held block that carries a
    prefix key carries the key of the tokens its holder computed into it (it was not evicted under it)."""
    kv = llm.engine.kv
    live = llm.engine.scheduler.running
    holders = Counter(block_id for seq in live for block_id in kv.block_ids(seq.request_id))
    assert {b.block_id: b.ref_cnt for b in kv.pool.blocks if b.ref_cnt} == dict(holders)
    for seq in live:
        computed = seq.token_ids[: seq.num_computed_tokens]
        for block_id, key in zip(kv.block_ids(seq.request_id), hash_full_blocks(computed, BS, seq.cache_salt,
                                                                                  namespace=kv.hash_namespace)):
            assert kv.pool.blocks[block_id].block_hash in (None, key)


def test_small_pool_evicts_cached_blocks_never_live_ones_and_keeps_outputs(model_dir):
    system = tokens(48, 30)
    prompts = [system + tokens(8 + 3 * i, 31 + i) for i in range(12)]
    params = greedy(16)
    reference = tiny_llm(model_dir, enable_prefix_caching=False).generate(prompts, params)
    expected = [o.outputs[0].token_ids for o in reference]

    llm = tiny_llm(model_dir, num_blocks=24)
    engine = llm.engine
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", prompt, params)
        results = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
            check_live_blocks(llm)
        assert [results[f"{round_}-{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
        assert_all_blocks_free(llm)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0  # the pool really was short
    assert 0 < stats["prefix_cache_hits"] < stats["prefix_cache_queries"]
    assert 0 < stats["num_cached_blocks"] <= stats["num_blocks"]
