"""The engine allocates exactly the KV cache the planner predicts for its config and logs the planner's line;
its stats count blocks and tokens correctly during and after a run."""
import json
import logging

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import parse_size
from kvserve.planner.capacity import plan_kv_cache
from kvserve.planner.model_spec import ModelSpec
from tests.conftest import make_tiny_model

MAX_MODEL_LEN = 128
STATS_KEYS = {"num_blocks", "num_free_blocks", "num_used_blocks", "num_preemptions", "num_prefill_tokens",
              "num_decode_tokens", "slot_waste_tokens"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {  # KV bytes per token in fp32: 2 (K, V) x 2 layers x kv_heads x head_dim x 4
        "llama-gqa": make_tiny_model(tmp_path_factory.mktemp("gqa"), "llama-gqa"),  # 2 x 16: 512
        "llama-mqa": make_tiny_model(tmp_path_factory.mktemp("mqa"), "llama-mqa"),  # 1 x 16: 256
        "qwen3-wide-heads": make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3-gqa", head_dim=32),  # 2 x 32
    }


@pytest.mark.parametrize("kind", ["llama-mqa", "qwen3-wide-heads"])
@pytest.mark.parametrize("budget", ["1MiB", 200_000, 131_072])  # 131,072 B: exactly 128 tokens of qwen3-wide-heads
def test_engine_allocates_the_planned_cache_and_logs_its_line(model_dirs, kind, budget, caplog):
    model_dir = model_dirs[kind]
    plan = plan_kv_cache(ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text())),
                         parse_size(budget), 16, "fp32", MAX_MODEL_LEN)
    caplog.set_level(logging.INFO, logger="kvserve")
    llm = LLM(str(model_dir), kv_cache_memory=budget, max_model_len=MAX_MODEL_LEN)
    engine = llm.engine

    assert engine.kv.pool.num_blocks == plan.num_blocks
    assert engine.cache.nbytes == plan.kv_cache_bytes <= parse_size(budget)
    assert engine.cache.k.shape[1] == plan.kv_cache_tokens == plan.num_blocks * 16
    assert llm.stats()["num_blocks"] == plan.num_blocks
    logged = [r.getMessage() for r in caplog.records if r.name == "kvserve" and r.getMessage().startswith("KV cache")]
    assert logged == [plan.summary_line("float32")]


@pytest.mark.parametrize("kv_cache_dtype, described", [
    ("bfloat16", "bfloat16"), ("fp8", "fp8_e4m3, per-token-head scales"), ("fp8_e5m2", "fp8_e5m2, per-token-head scales"),
    ("int8", "int8, per-token-head scales"), ("int4", "int4, keys per channel per block"),
    ("nuq4", "nuq4, 4-bit keys per channel per block"), ("nuq3", "nuq3, 3-bit keys per channel per block"),
    ("nuq3k4v", "nuq3k4v, 3-bit keys per channel per block, 4-bit Lloyd-Max codes"),
])
def test_engine_allocates_what_the_planner_predicts_for_each_format(model_dirs, kv_cache_dtype, described, caplog):
    model_dir = model_dirs["qwen3-wide-heads"]
    planner_name = {"fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    plan = plan_kv_cache(ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text())),
                         parse_size("1MiB"), 16, planner_name, MAX_MODEL_LEN)
    caplog.set_level(logging.INFO, logger="kvserve")
    engine = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=MAX_MODEL_LEN,
                 kv_cache_dtype=kv_cache_dtype).engine

    assert engine.kv.pool.num_blocks == plan.num_blocks
    assert engine.cache.nbytes == plan.kv_bytes_per_token * plan.kv_cache_tokens <= parse_size("1MiB")
    logged = [r.getMessage() for r in caplog.records if r.name == "kvserve" and r.getMessage().startswith("KV cache")]
    assert len(logged) == 1 and logged[0].startswith(f"KV cache ({described}")
    assert logged[0].startswith(plan.summary_line(engine.cache.describe()))
    assert ("full-precision staging" in logged[0]) == (kv_cache_dtype in ("int4", "nuq4", "nuq3", "nuq3k4v"))


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["llama-gqa"]), kv_cache_memory="1MiB", max_model_len=MAX_MODEL_LEN,
               enable_prefix_caching=False)


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_stats_after_a_run(llm):
    lengths, max_tokens = [5, 20, 33], [4, 7, 1]
    before = llm.stats()
    outputs = llm.generate(prompts(lengths), [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                                              for m in max_tokens])
    stats = llm.stats()
    assert STATS_KEYS <= set(stats)
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    assert stats["num_prefill_tokens"] - before["num_prefill_tokens"] == sum(lengths)
    assert stats["num_decode_tokens"] - before["num_decode_tokens"] == sum(m - 1 for m in max_tokens)
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["slot_waste_tokens"] == 0 and stats["num_preemptions"] == 0


def test_stats_during_a_run(llm):
    engine = llm.engine
    lengths, max_tokens = [5, 20, 33], [4, 7, 1]
    for i, (prompt, m) in enumerate(zip(prompts(lengths), max_tokens)):
        engine.add_request(f"live-{i}", prompt, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    engine.step()  # one prefill for all three; the 33-token request is done after its first token
    stats = llm.stats()
    # live: 5 tokens in 1 block (11 slots unused), 20 tokens in 2 blocks (12 unused)
    assert stats["num_used_blocks"] == 3 and stats["num_free_blocks"] == stats["num_blocks"] - 3
    assert stats["slot_waste_tokens"] == 11 + 12
    engine.step()  # decode: the 6th and 21st tokens fit the same blocks
    assert llm.stats()["slot_waste_tokens"] == 10 + 11
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.stats()["num_used_blocks"] == 0


def test_stats_count_preemptions(model_dirs):
    # 4 blocks: two requests growing to 40 tokens each (3 blocks) cannot both stay
    llm = LLM(str(model_dirs["llama-gqa"]), kv_cache_memory=4 * 16 * 512, max_model_len=64)
    assert llm.stats()["num_blocks"] == 4
    lengths = [20, 20]
    llm.generate(prompts(lengths), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_preemptions"] >= 1
    assert stats["num_decode_tokens"] + stats["num_prefill_tokens"] > sum(lengths) + 2 * 19  # recomputed work
    assert stats["num_used_blocks"] == 0
