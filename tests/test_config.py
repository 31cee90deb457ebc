"""EngineConfig's groups: built once from the flat keyword arguments, each refusing its own bad values by name,
with the checks across groups made by EngineConfig."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from kvserve.config import (CacheConfig, CompileConfig, EngineConfig, EvictionConfig, SchedulerConfig,
                            TierConfig)

CACHE = dict(kv_cache_dtype="auto", block_size=16, kv_cache_memory=None, enable_prefix_caching=True)
SCHEDULER = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=None)
COMPILE = dict(enforce_eager=False, compile_decode=False, compile_gemms=False, batch_invariant=False)
EVICTION = dict(kv_eviction="none", kv_sink_tokens=4, kv_recent_tokens=1024, kv_budget_tokens=2048)
TIER = dict(kv_disk_cache=None, kv_disk_cache_size="20GiB")


def test_the_groups_hold_the_flat_arguments():
    config = EngineConfig(block_size=32, kv_cache_memory="1GiB", max_num_seqs=8, compile_decode=True,
                          kv_eviction="streaming", kv_disk_cache="/tmp/kv")
    assert config.cache == CacheConfig(**{**CACHE, "block_size": 32, "kv_cache_memory": "1GiB"})
    assert config.scheduler == SchedulerConfig(**{**SCHEDULER, "max_num_seqs": 8})
    assert config.compile == CompileConfig(**{**COMPILE, "compile_decode": True})
    assert config.eviction == EvictionConfig(**{**EVICTION, "kv_eviction": "streaming"})
    assert config.tier == TierConfig(**{**TIER, "kv_disk_cache": "/tmp/kv"})
    assert config.kv_cache_memory_bytes == config.cache.kv_cache_memory_bytes == 1 << 30
    assert config.kv_disk_cache_size_bytes == config.tier.kv_disk_cache_size_bytes == 20 << 30


def test_the_groups_are_not_keyword_arguments():
    """LLM(**dataclasses.asdict(config)) is how the CLI and the benches start an engine."""
    config = EngineConfig(block_size=32)
    assert set(dataclasses.asdict(config)) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert not {"cache", "scheduler", "compile", "eviction", "tier"} & set(dataclasses.asdict(config))
    assert EngineConfig(**dataclasses.asdict(config)) == config


def test_the_groups_survive_pickling_and_follow_replace():
    config = EngineConfig(block_size=32, kv_eviction="h2o")
    copy = pickle.loads(pickle.dumps(config))  # as Ray ships it to a replica
    assert copy == config and copy.cache == config.cache and copy.eviction == config.eviction
    assert dataclasses.replace(config, block_size=8).cache.block_size == 8


@pytest.mark.parametrize("group, defaults, option, value, message", [
    (CacheConfig, CACHE, "kv_cache_dtype", "int3", "kv_cache_dtype='int3' is not supported"),
    (CacheConfig, CACHE, "block_size", 0, "block_size must be a positive integer, got 0"),
    (CacheConfig, CACHE, "kv_cache_memory", "2XB", "cannot read '2XB' as a size"),
    (SchedulerConfig, SCHEDULER, "max_num_seqs", 0, "max_num_seqs must be a positive integer"),
    (SchedulerConfig, SCHEDULER, "max_model_len", 1.5, "max_model_len must be a positive integer"),
    (CompileConfig, COMPILE, "batch_invariant", 1, "batch_invariant must be True or False, got 1"),
    (EvictionConfig, EVICTION, "kv_eviction", "lru", "kv_eviction='lru' is not supported"),
    (EvictionConfig, EVICTION, "kv_sink_tokens", -1, "kv_sink_tokens must be a non-negative integer"),
    (TierConfig, TIER, "kv_disk_cache", " ", "kv_disk_cache must be a directory path"),
])
def test_each_group_refuses_its_own_bad_values(group, defaults, option, value, message):
    with pytest.raises(ValueError, match=message):
        group(**{**defaults, option: value})
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{option: value})


def test_compiled_steps_are_the_default_and_each_way_out_is_named(monkeypatch):
    monkeypatch.delenv("KVSERVE_EAGER_STEPS", raising=False)
    assert EngineConfig().compile.decode_steps and not EngineConfig().compile.asked
    assert EngineConfig(compile_decode=True).compile.asked and EngineConfig(compile_gemms=True).compile.asked
    for options, reason in [(dict(enforce_eager=True), "--enforce-eager"),
                            (dict(compile_decode=False), "--no-compile-decode")]:
        compile = EngineConfig(**options).compile
        assert not compile.decode_steps and compile.eager_reason == reason
        with pytest.raises(ValueError, match=f"compile_gemms=True applies to the compiled decode step, which {reason} "
                                             "turns off"):
            EngineConfig(**options, compile_gemms=True)
    with pytest.raises(ValueError, match="compile_decode=True contradicts enforce_eager=True"):
        EngineConfig(compile_decode=True, enforce_eager=True)
    with pytest.raises(ValueError, match="compile_decode must be True or False, got 'yes'"):
        EngineConfig(compile_decode="yes")
    monkeypatch.setenv("KVSERVE_EAGER_STEPS", "1")  # the suite's default (tests/conftest.py): eager unless asked
    assert not EngineConfig().compile.decode_steps
    assert EngineConfig().compile.eager_reason == "KVSERVE_EAGER_STEPS=1 in the environment"
    assert EngineConfig(compile_decode=True).compile.decode_steps and EngineConfig(compile_gemms=True).compile.decode_steps


@pytest.mark.parametrize("dtype, plane, refused, taken", [("int4", 2, 15, 6), ("nuq4", 2, 15, 6), ("nuq3", 8, 12, 24),
                                                         ("nuq3k4v", 8, 4, 8)])
def test_packed_formats_need_a_block_size_their_byte_planes_divide(dtype, plane, refused, taken):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{dtype}' packs {plane} tokens of a block per byte: "
                                         f"block_size must be a multiple of {plane}, got {refused}"):
        CacheConfig(**{**CACHE, "kv_cache_dtype": dtype, "block_size": refused})
    assert CacheConfig(**{**CACHE, "kv_cache_dtype": dtype, "block_size": taken}).block_size == taken


def test_the_h2o_budget_is_counted_in_the_cache_blocks():
    h2o = EvictionConfig(**{**EVICTION, "kv_eviction": "h2o", "kv_recent_tokens": 20, "kv_budget_tokens": 48})
    h2o.check_budget(8)  # 1 + 3 + 1 blocks of 8 fit in 6
    with pytest.raises(ValueError, match="kv_budget_tokens=48 leaves no room .* give at least 64 tokens"):
        h2o.check_budget(16)
    with pytest.raises(ValueError, match="kv_budget_tokens=48 leaves no room"):
        EngineConfig(kv_eviction="h2o", kv_recent_tokens=20, kv_budget_tokens=48, block_size=16)


@pytest.mark.parametrize("options, message", [
    (dict(batch_invariant=True, device="cuda"), "batch_invariant=True is guaranteed on a CPU only"),
    (dict(batch_invariant=True, kv_eviction="streaming"), "batch_invariant=True does not cover kv_eviction"),
    (dict(speculative_config={"method": "ngram"}, kv_eviction="h2o"), "speculative_config does not combine"),
    (dict(kv_disk_cache="/tmp/kv", enable_prefix_caching=False), "needs enable_prefix_caching=True"),
])
def test_checks_across_groups(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
