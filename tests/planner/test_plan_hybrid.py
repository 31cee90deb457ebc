"""`kvserve plan` for hybrid models prints what the engine allocates: KV per token, the float32 state per request,
a checkpoint's size, the state slots and checkpoints taken out of the budget before the KV blocks (one slot per
--max-num-seqs, as many checkpoints with prefix caching), and a concurrency that counts both KV and slots — the
same numbers the engine plans for the same budget."""
import json
import logging

import pytest

from kvserve import EngineConfig, LLMEngine
from kvserve.cli import main
from kvserve.planner.capacity import plan_state
from kvserve.planner.kv_size import state_slot_bytes
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.units import GiB
from tests.model.test_qwen3_next import make_hybrid_model

H200_FP8 = ("qwen3-next-80b-a3b", "--gpu", "h200", "--weights-dtype", "fp8")


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_report_names_state_checkpoints_and_the_slots_taken_first(capsys):
    assert main(["plan", *H200_FP8, "--max-model-len", "32768"]) == 0
    out = capsys.readouterr().out
    slot = 36 * (32 * 128 * 128 + 3 * 8_192) * 4  # 36 linear layers' recurrent state and conv tail, float32
    assert slot == state_slot_bytes(load_model_spec("qwen3-next-80b-a3b"))
    assert "KV bytes/token = 2 (K, V) × 12 attention layers (of 48) × 2 KV heads" in out
    assert ("State per request: 75.38 MiB (conv tail + recurrent state of 36 linear-attention layers, float32 as the "
            "engine keeps it); a checkpoint, the state at a block boundary that a prefix hit resumes from, is one "
            "more 75.38 MiB.") in out
    assert "64 slots (--max-num-seqs) + 64 checkpoints (prefix caching) = 128 × 75.38 MiB = 9.42 GiB" in out
    assert "− state: 64 slots + 64 checkpoints × 75.38 MiB" in out
    assert "state cache: 64 slots + 64 checkpoints × 75.38 MiB" in out  # the engine's start-up line


def test_json_state_comes_out_of_the_budget_and_caps_concurrency(capsys):
    data = plan_json(capsys, *H200_FP8, "--max-model-len", "32768")
    slot = data["fixed_state_bytes_per_request"]
    assert data["num_state_slots"] == 64 and data["num_state_checkpoints"] == 64
    assert data["state_checkpoint_bytes"] == slot and data["state_cache_bytes"] == 128 * slot
    block_bytes = 16 * data["kv_bytes_per_token"]
    assert data["num_blocks"] == (data["kv_budget_bytes"] - 128 * slot) // block_bytes
    by_kv = data["kv_cache_bytes"] / (32_768 * data["kv_bytes_per_token"])
    assert data["max_concurrency"] == by_kv < 64
    short = data["per_request"][0]
    assert short["tokens"] == 2_048 and short["max_concurrency"] == 64  # short requests: one slot each runs out first


def test_flags_change_the_slots_the_way_the_engine_would(capsys):
    default = plan_json(capsys, *H200_FP8)
    no_checkpoints = plan_json(capsys, *H200_FP8, "--no-enable-prefix-caching")
    fewer = plan_json(capsys, *H200_FP8, "--max-num-seqs", "8")
    slot = default["fixed_state_bytes_per_request"]
    assert no_checkpoints["num_state_checkpoints"] == 0 and no_checkpoints["state_cache_bytes"] == 64 * slot
    assert no_checkpoints["num_blocks"] > default["num_blocks"]
    assert fewer["num_state_slots"] == fewer["num_state_checkpoints"] == 8
    assert fewer["per_request"][0]["max_concurrency"] == 8


def test_qwen3_6_as_the_seed_states_it(capsys):
    # the FP8-KV seed article's example: 40 layers of which 10 attention, 8 KV heads of 128, FP16: 40 KB a token,
    # about 1.3 GB for a 32K request, 21 GB for 16 of them, 35 GB of weights on an 80 GB GPU
    data = plan_json(capsys, "qwen3.6-seed-example", "--gpu", "h100", "--weights-dtype", "fp8", "--kv-cache-dtype",
                     "fp16", "--max-model-len", "32768", "--max-num-seqs", "16")
    assert data["kv_bytes_per_token"] == 2 * 10 * 8 * 128 * 2 == 40_960
    assert 32_768 * data["kv_bytes_per_token"] == 1_342_177_280  # the seed's "about 1.3 GB"
    assert round(16 * 32_768 * data["kv_bytes_per_token"] / 1e9) == 21
    assert data["weights_bytes"] == 35_000_000_000
    assert data["max_concurrency"] == 16  # the 16 requests fit, with their state slots


def test_the_real_qwen3_6_35b_a3b(capsys):
    # the released checkpoint's layout (Qwen3_5MoeForConditionalGeneration, its text model under text_config):
    # 2 KV heads of 256, so half the seed's KV; 30 Gated DeltaNet layers of 32 value heads hold the state
    data = plan_json(capsys, "qwen3.6-35b-a3b", "--gpu", "h100", "--weights-dtype", "fp8", "--max-model-len", "32768")
    assert data["kv_bytes_per_token"] == 2 * 10 * 2 * 256 * 2 == 20_480
    conv_channels = 2 * 16 * 128 + 32 * 128
    assert data["fixed_state_bytes_per_request"] == 30 * (32 * 128 * 128 + 3 * conv_channels) * 4
    assert round(data["fixed_state_bytes_per_request"] / 2**20, 2) == 62.81
    assert data["state_checkpoint_bytes"] == data["fixed_state_bytes_per_request"]
    assert 40 < data["max_concurrency"] < 64  # the KV of 32K requests, not the 64 slots, bounds it


def test_a_model_without_linear_layers_reports_no_state(capsys):
    data = plan_json(capsys, "llama-3.1-8b", "--gpu", "rtx-4090", "--max-model-len", "8192")
    assert data["num_state_slots"] is None and data["state_cache_bytes"] is None
    assert main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--max-model-len", "8192"]) == 0
    assert "State per request" not in capsys.readouterr().out


def test_the_plan_is_what_the_engine_allocates(tmp_path, capsys, caplog):
    """The same budget through `kvserve plan` (all of a 4 MiB "GPU" for the cache) and through the engine."""
    path = make_hybrid_model(tmp_path, "qwen3_next")
    data = plan_json(capsys, str(path), "--gpu-memory", "4MiB", "--gpu-memory-utilization", "1", "--weights-gib",
                     "0", "--overhead-gib", "0", "--kv-cache-dtype", "fp32", "--max-model-len", "256",
                     "--max-num-seqs", "8")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", kv_cache_dtype="fp32",
                                        max_model_len=256, max_num_seqs=8))
    plan = engine.cache_plan
    assert data["kv_budget_bytes"] == plan.kv_budget_bytes == 4 * GiB // 1024
    assert data["num_blocks"] == plan.num_blocks and data["kv_cache_bytes"] == plan.kv_cache_bytes
    assert data["state_cache_bytes"] == engine.runner.state_cache.nbytes == plan.state.total_bytes
    assert data["num_state_slots"] == engine.kv.state.num_slots == 8
    assert data["num_state_checkpoints"] == engine.kv.checkpoints.num_slots == 8
    # the KV pool alone would hold 61 requests of 256 tokens; the 8 slots are what bounds it
    assert data["max_concurrency"] == plan.max_concurrency == 8
    assert "maximum concurrency for 256 tokens per request: 8.00x" in caplog.text


def test_a_hybrid_plan_needs_a_slot():
    spec = load_model_spec("qwen3-next-80b-a3b")
    with pytest.raises(ValueError, match="at least one state slot"):
        plan_state(spec, 0)
    assert plan_state(load_model_spec("llama-3.1-8b"), 8) is None  # no linear layers: no state
