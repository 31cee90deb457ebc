"""`--kv-eviction adakv` inside the engine: with a budget above the sequence it equals the full cache; compressed,
it never reads a freed head block (they are poisoned with NaN), stays within its budget between steps, and leaks
nothing under preemption, aborts and n > 1; what it does not run with is refused by name."""
import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.retrieval_heads import DIRECTORY_NAME, METHOD, model_digest
from kvserve.kv.eviction import HEAD_POLICIES
from kvserve.kv.head_manager import HeadStreamManager
from kvserve.kv.head_streams import HeadStreamReader, Int4HeadStreamKVCache
from kvserve.kv.scorers import ObservedAttentionScorer
from kvserve.planner.kv_size import HEAD_STREAM_POLICIES
from kvserve.private_files import write_private
from tests.conftest import make_tiny_model

MAX_LEN = 256
ADAKV = dict(kv_eviction="adakv", kv_sink_tokens=4, kv_recent_tokens=8, kv_budget_tokens=48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("head_streams"), "llama-gqa")


def make(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"kv_cache_memory": "1MiB", "max_model_len": MAX_LEN, "max_num_batched_tokens": 32,
                                  **options})


def greedy(n: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **extra)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scored(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """The prompt's log-probabilities (prefilled in chunks of max_num_batched_tokens, compressing between them)."""
    return llm.generate(token_ids, SamplingParams(max_tokens=1, prompt_logprobs=-1))[0].prompt_logprobs[1:]


def test_a_budget_above_the_sequence_equals_the_full_cache(model_dir):
    tokens = prompt(100)
    full, heads = make(model_dir), make(model_dir, **{**ADAKV, "kv_budget_tokens": 200})
    torch.testing.assert_close(scored(heads, tokens), scored(full, tokens), atol=1e-4, rtol=1e-4)
    assert heads.generate(tokens, greedy(40))[0].outputs[0].token_ids == \
        full.generate(tokens, greedy(40))[0].outputs[0].token_ids
    assert heads.stats()["num_evicted_blocks"] == 0


def test_bfloat16_storage_with_room_for_everything_equals_the_bfloat16_full_cache(model_dir):
    tokens = prompt(60, seed=4)
    full = make(model_dir, kv_cache_dtype="bfloat16")
    heads = make(model_dir, kv_cache_dtype="bfloat16", **{**ADAKV, "kv_budget_tokens": 200})
    assert "bfloat16" in heads.engine.cache.describe()
    torch.testing.assert_close(scored(heads, tokens), scored(full, tokens), atol=1e-4, rtol=1e-4)


def test_int8_storage_with_room_for_everything_equals_the_int8_full_cache(model_dir):
    """Each slot one token of one head with its own scale: the int8 format's per-token-head quantization, so with
    nothing evicted the logits are the int8 full cache's; its pool holds what the planner counts (1 byte an element,
    2 a scale)."""
    tokens = prompt(60, seed=4)
    full = make(model_dir, kv_cache_dtype="int8")
    heads = make(model_dir, kv_cache_dtype="int8", **{**ADAKV, "kv_budget_tokens": 200})
    cache = heads.engine.cache
    assert cache.describe().startswith("int8, blocks of 16 tokens of one layer's one KV head")
    assert cache.k.dtype == torch.int8 and cache.nbytes == heads.engine.cache_plan.kv_cache_bytes
    torch.testing.assert_close(scored(heads, tokens), scored(full, tokens), atol=1e-4, rtol=1e-4)
    float_heads = scored(make(model_dir, **{**ADAKV, "kv_budget_tokens": 200}), tokens)
    assert float((scored(heads, tokens) - float_heads).abs().max()) > 0  # stored as int8, not as floats


def test_int4_streams_hold_the_planned_bytes_and_attend_in_their_rotated_basis(model_dir, monkeypatch):
    """Rotated vectors as int4 with a scale and zero point per slot: the pool holds what the planner counts (half a
    byte an element, 4 bytes of statistics a slot); attention in the rotated basis (queries rotated, outputs rotated
    back) equals attention over the stored vectors rotated back; int4 moves the log-probabilities from the float
    cache's about as far as the int4 format does."""
    tokens = prompt(60, seed=4)
    heads = make(model_dir, kv_cache_dtype="int4", **{**ADAKV, "kv_budget_tokens": 200})
    cache = heads.engine.cache
    assert cache.describe().startswith("int4, blocks of 16 tokens of one layer's one KV head")
    assert cache.k.dtype == torch.uint8 and cache.k.shape[1] == 8  # 16 dims, two codes a byte
    assert cache.nbytes == heads.engine.cache_plan.kv_cache_bytes
    rotated = scored(heads, tokens)
    full = scored(make(model_dir), tokens)
    int4_format = float((scored(make(model_dir, kv_cache_dtype="int4"), tokens) - full).abs().mean())
    assert 0 < float((rotated - full).abs().mean()) < 2 * int4_format
    with monkeypatch.context() as patch:  # the plain reader: every stored token rotated back, then attention
        patch.setattr(cache, "reader", HeadStreamReader(cache))
        torch.testing.assert_close(scored(heads, tokens), rotated, atol=1e-4, rtol=1e-4)


def test_int4_slots_round_trip_within_half_a_step_of_their_rotated_grid():
    from kvserve.planner.layout import KVLayout

    cache = Int4HeadStreamKVCache(KVLayout.from_layer_windows([None]), 4, 16, 2, 64)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(16, 64, generator=gen) * torch.linspace(0.1, 8, 64) for _ in range(2))  # uneven channels
    cache._store(torch.arange(16), k, v)
    keys, values, _ = cache.gather_streams(torch.tensor([0]))
    for x, back, scale in ((k, keys, cache.k_scale), (v, values, cache.v_scale)):
        steps = scale[:16].float()[:, None]  # per slot, in the rotated basis: within half a step in every element
        assert bool((((back - x) @ cache.basis).abs() <= steps / 2 + 1e-3 * steps.abs() + 1e-6).all())


def test_int4_streams_of_an_odd_head_dim_are_refused_by_name():
    from kvserve.planner.layout import KVLayout

    with pytest.raises(ValueError, match="head_dim 63 must be even"):
        Int4HeadStreamKVCache(KVLayout.from_layer_windows([None]), 4, 16, 2, 63)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_streams_compress_and_never_read_a_freed_block(model_dir, monkeypatch, kv_cache_dtype):
    tokens = prompt(200, seed=1)
    options = {**ADAKV, "kv_eviction": "perhead-mix", "kv_cache_dtype": kv_cache_dtype}
    clean = scored(make(model_dir, **options), tokens)
    llm = make(model_dir, kv_cache_memory=8 * make(model_dir, **options).engine.cache_plan.block_bytes, **options)
    storage = llm.engine.cache
    release = HeadStreamManager._release

    def poisoned_release(self, block_ids):  # a NaN scale dequantizes every element of its slot to NaN
        rows = storage._block_rows(block_ids)
        storage.k_scale[rows], storage.v_scale[rows] = float("nan"), float("nan")
        release(self, block_ids)

    monkeypatch.setattr(HeadStreamManager, "_release", poisoned_release)
    poisoned = scored(llm, tokens)
    stats = llm.stats()
    assert stats["num_evicted_blocks"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert bool(poisoned.isfinite().all())
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


@pytest.mark.parametrize("name", HEAD_STREAM_POLICIES)
def test_every_per_head_policy_compresses_with_its_scorer_and_gives_every_block_back(model_dir, name, tmp_path,
                                                                                      monkeypatch):
    if HEAD_POLICIES[name][3]:  # weighted by retrieval scores: this model's, as if measured before (no tokenizer)
        monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
        path = tmp_path / DIRECTORY_NAME / f"{model_digest(model_dir)}-m{METHOD}.json"
        write_private(path, json.dumps({"method": METHOD, "scores": [[0.5, 0.0], [0.0, 0.0]]}))
    llm = make(model_dir, **{**ADAKV, "kv_eviction": name})
    assert llm.engine.kv.groups[0].scorer.name == HEAD_POLICIES[name][0]
    logprobs = scored(llm, prompt(150, seed=5))
    stats = llm.stats()
    assert bool(logprobs.isfinite().all())
    assert stats["num_evicted_blocks"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_freed_head_blocks_are_never_read(model_dir, monkeypatch):
    tokens = prompt(200, seed=1)
    clean = scored(make(model_dir, **ADAKV), tokens)
    # a pool this small hands freed head blocks out again: their stale slots must read as zeros, not NaN
    llm = make(model_dir, kv_cache_memory=8 * make(model_dir).engine.cache_plan.block_bytes, **ADAKV)
    storage = llm.engine.cache
    release = HeadStreamManager._release

    def poisoned_release(self, block_ids):
        rows = storage._block_rows(block_ids)
        storage.k[rows], storage.v[rows] = float("nan"), float("nan")
        release(self, block_ids)

    monkeypatch.setattr(HeadStreamManager, "_release", poisoned_release)
    poisoned = scored(llm, tokens)
    assert llm.stats()["num_evicted_blocks"] > 0
    assert bool(poisoned.isfinite().all())
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


def test_streams_stay_within_the_budget_between_steps(model_dir):
    llm = make(model_dir, **ADAKV)
    engine = llm.engine
    engine.add_request("a", prompt(90, seed=2), greedy(100))
    manager = engine.kv.groups[0]
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            per_head = manager.streams[seq.request_id].lengths.float().mean(dim=1)
            assert float(per_head.max()) <= ADAKV["kv_budget_tokens"] + 16
    assert llm.stats()["num_evicted_blocks"] > 0


def test_nothing_leaks_under_preemption_aborts_and_n_above_one(model_dir):
    llm = make(model_dir, **ADAKV)
    engine = llm.engine
    head_block_bytes = engine.cache_plan.block_bytes // (2 * 2)  # 2 layers x 2 KV heads per planned block
    assert engine.kv.pool.num_blocks * head_block_bytes == engine.cache_plan.kv_cache_bytes
    tight = make(model_dir, kv_cache_memory=engine.cache_plan.block_bytes * 9, **ADAKV)
    engine = tight.engine
    for i, n in enumerate([60, 70, 80]):
        engine.add_request(f"r{i}", prompt(n, seed=i), greedy(60))
    engine.add_request("n2", prompt(20, seed=9), SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=40))
    engine.add_request("gone", prompt(30, seed=8), greedy(200))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 20:
            engine.abort_request("gone")
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["num_evicted_blocks"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert engine.cache.query_stats == {}  # every sequence's query statistics went with it


@pytest.mark.parametrize("option, value", [("kv_cache_dtype", "nuq3"), ("kv_cache_dtype", "nuq4"),
                                           ("kv_cache_dtype", "fp8"), ("compile_decode", True)])
def test_what_head_streams_do_not_run_with_is_refused_by_name(model_dir, option, value):
    with pytest.raises(ValueError, match=option):
        make(model_dir, **ADAKV, **{option: value})


def test_a_budget_the_kept_tokens_fill_is_refused(model_dir):
    with pytest.raises(ValueError, match="kv_budget_tokens=28 leaves no room"):
        make(model_dir, **{**ADAKV, "kv_budget_tokens": 28})


def test_per_head_sequences_stay_out_of_the_prefix_index(model_dir):
    llm = make(model_dir, **ADAKV)
    tokens = prompt(100, seed=3)
    first = llm.generate(tokens, greedy(5))[0].outputs[0].token_ids
    again = llm.generate(tokens, greedy(5))[0].outputs[0].token_ids
    stats = llm.stats()
    assert first == again
    assert stats["prefix_cache_hits"] == 0 and stats["num_cached_blocks"] == 0


def test_an_observed_scorer_keeps_each_sequences_latest_queries_alone_or_batched(model_dir, monkeypatch):
    monkeypatch.setattr(ObservedAttentionScorer, "window_queries", 16)
    # a budget above the sequences: nothing is dropped, so the queries are the full cache's alone or batched on any
    # CPU (what a compression keeps may flip on a near-tie of scores that round differently)
    options = {**ADAKV, "kv_eviction": "perhead-observed-span", "kv_budget_tokens": 200}

    def windows(prompts: dict[str, list[int]]) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
        engine = make(model_dir, **options).engine
        assert engine.cache.window_queries == 16
        assert "each sequence's latest 16 queries kept for its scorer outside the pool" in engine.cache.describe()
        for request_id, tokens in prompts.items():
            engine.add_request(request_id, tokens, greedy(12))
        seen = {request_id: [] for request_id in prompts}
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                stats = engine.cache.query_stats[seq.request_id]
                n = seq.num_computed_tokens
                order = stats.window_positions.argsort()
                positions = [p for p in stats.window_positions[order].tolist() if p >= 0]
                assert positions == list(range(max(ADAKV["kv_sink_tokens"], n - 16), n))
                seen[seq.request_id].append((positions, stats.window[:, :, order[-len(positions):]].clone()))
        return seen

    assert make(model_dir, **ADAKV).engine.cache.window_queries == 0  # expected attention reads no window
    alone = windows({"a": prompt(70, seed=3)})
    batched = windows({"b": prompt(45, seed=4), "a": prompt(70, seed=3)})
    common = [w for w in batched["a"] if w[0] in [v[0] for v in alone["a"]]]
    assert len(common) >= 10
    for positions, window in common:
        torch.testing.assert_close(window, dict((tuple(p), w) for p, w in alone["a"])[tuple(positions)],
                                   atol=1e-4, rtol=1e-4)
