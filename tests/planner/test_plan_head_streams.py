"""The plan under per-(layer, KV head) streams: the pool counted in head blocks, the context a GiB serves when a
request holds its budget per head instead of every token, and the KV formats the streams cannot store refused as the
engine refuses them."""
import json

import pytest

from kvserve.cli import main
from kvserve.planner.capacity import plan_kv_cache
from kvserve.planner.kv_size import KV_DTYPES, eviction_max_blocks
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.units import GiB, format_bytes


def test_summary_counts_head_blocks_and_context_tokens_per_gib():
    spec = load_model_spec("smollm2-135m")
    bound = eviction_max_blocks("adakv", 4, 32, 1024, 16)
    plan = plan_kv_cache(spec, GiB, 16, "bf16", 8192, "adakv", bound)
    full = plan_kv_cache(spec, GiB, 16, "bf16", 8192)
    line = plan.summary_line()
    assert f"as {plan.num_blocks * spec.num_kv_layers * spec.num_kv_heads:,} blocks of one layer's one KV head" in line
    assert f"{plan.context_tokens_per_gib():,.0f} tokens of context per GiB at 8,192 tokens" in line
    # a request of 8,192 tokens holds (1,024 + 2 blocks) per head instead of 8,192: that many times the context
    ratio = plan.context_tokens_per_gib() / full.context_tokens_per_gib()
    assert abs(ratio - 8192 / (bound * 16)) < 1e-6
    assert "head" not in full.summary_line()


@pytest.mark.parametrize("kv_cache_dtype, refused", [("int8", False), ("int4", False), ("nuq4", True), ("fp8", True),
                                                     ("bfloat16", False), ("float32", False), ("auto", False)])
def test_the_plan_refuses_what_the_engine_refuses(capsys, kv_cache_dtype, refused):
    # per-head streams store float, int8 or int4 K/V: the engine refuses other quantized formats with them, so the
    # plan does too
    argv = ["plan", "smollm2-135m", "--kv-eviction", "perhead-span", "--kv-cache-dtype", kv_cache_dtype, "--json"]
    assert main(argv) == (2 if refused else 0)
    err = capsys.readouterr().err
    refusal = "is not supported with kv_eviction='perhead-span' (per-head streams store float, int8 or int4 K/V)"
    assert (refusal in err) == refused
    assert not refused or f"kv_cache_dtype {KV_DTYPES[kv_cache_dtype].name} " in err


def test_int8_streams_are_planned_with_the_scales_the_engine_keeps(capsys):
    # per-head streams keep a scale per token and head: int8 plans 1 byte an element and 2 a scale, and per-tensor
    # scales (which would count fewer bytes than the engine holds) are refused
    argv = ["plan", "smollm2-135m", "--kv-eviction", "perhead-mix", "--kv-cache-dtype", "int8", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 2)
    assert main([*argv, "--kv-scales", "per-tensor"]) == 2
    assert "--kv-scales per-tensor is not supported with kv_eviction='perhead-mix'" in capsys.readouterr().err


def test_int4_streams_are_planned_per_token_as_the_engine_keeps_them(capsys):
    # a slot moves alone when a stream is compacted, so int4 streams keep keys per token too (not per channel over a
    # block as the int4 format does): half a byte an element, a 2-byte scale and zero point per token and head
    argv = ["plan", "smollm2-135m", "--kv-eviction", "perhead-mix", "--kv-cache-dtype", "int4", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 2 * 30 * 3 * (32 + 4)
    spec = load_model_spec("smollm2-135m")
    streams = plan_kv_cache(spec, GiB, 16, "int4", 8192, "perhead-mix", eviction_max_blocks("perhead-mix", 4, 32,
                                                                                            1024, 16))
    assert streams.kv_bytes_per_token == 2 * 30 * 3 * (32 + 4)
    assert plan_kv_cache(spec, GiB, 16, "int4", 8192).kv_bytes_per_token == 30 * 3 * (32 + 4 + 32 + 64 * 4 // 16)


def test_the_plan_shows_tokens_per_gib_under_the_setting_without_a_gpu(capsys):
    # the engine's start-up line says the context a GiB serves under the setting; the plan says it too, for any
    # memory, and the same number as with a GPU's budget
    spec = load_model_spec("smollm2-135m")
    bound = eviction_max_blocks("perhead-span", 4, 32, 1024, 16)
    per_gib = plan_kv_cache(spec, GiB, 16, "bf16", 8192, "perhead-span", bound).context_tokens_per_gib()
    argv = ["plan", "smollm2-135m", "--kv-eviction", "perhead-span", "--kv-budget-tokens", "1024",
            "--kv-recent-tokens", "32", "--kv-sink-tokens", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"a request of 8,192 tokens holds {format_bytes(bound * 16 * 30 * 3 * 2 * 64 * 2)} of KV cache" in out
    assert f"{per_gib:,.0f} tokens of context per GiB ({8192 / (bound * 16):.1f}x the full cache's)" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context_tokens_per_gib"] == pytest.approx(per_gib)
