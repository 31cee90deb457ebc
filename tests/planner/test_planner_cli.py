"""`kvserve plan` through the real command line: tables, --json, exit status, errors."""
import json

import pytest

from kvserve.cli import main
from kvserve.model.embedded import embedded_gguf_path
from kvserve.planner.units import GiB, MiB, parse_memory_size
from tests.conftest import image_size


def plan_json(capsys, *argv) -> tuple[int, dict]:
    status = main(["plan", *argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_table_shows_the_substituted_formula_and_the_refusal(capsys):
    status = main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090"])
    out = capsys.readouterr().out
    assert status == 1  # one 131,072-token request does not fit
    assert "2 (K, V) × 32 layers × 8 KV heads × 128 head_dim × 2 B (bf16) = 131,072 B = 128 KiB" in out
    assert "KV cache: 2,632 blocks × 16 tokens = 42,112 tokens" in out
    assert "error:" in out and "largest max_model_len that fits is 42,112" in out


def test_json_has_the_documented_keys(capsys):
    status, data = plan_json(capsys, "llama-3.1-8b", "--gpu", "rtx-4090", "--max-model-len", "8192")
    assert status == 0
    for key in ("kv_bytes_per_token", "weights_bytes", "kv_budget_bytes", "kv_cache_tokens", "max_model_len",
                "max_concurrency", "fits", "error", "per_request"):
        assert key in data
    assert data["kv_bytes_per_token"] == 131_072
    assert data["fits"] is True and data["error"] is None
    assert 38_000 <= data["kv_cache_tokens"] <= 46_000
    assert [r["tokens"] for r in data["per_request"]] == [2_048, 8_192, 32_768, 131_072]
    assert data["per_request"][1]["bytes"] == GiB


def test_json_reports_the_refusal(capsys):
    status, data = plan_json(capsys, "llama-3.1-8b", "--gpu", "rtx-4090")
    assert status == 1
    assert data["fits"] is False
    assert "131,072" in data["error"] and "--max-model-len" in data["error"]


def test_fp8_flag_about_doubles_the_tokens(capsys):
    _, data = plan_json(capsys, "llama-3.1-8b", "--gpu", "rtx-4090", "--kv-cache-dtype", "fp8",
                        "--max-model-len", "8192")
    assert data["kv_bytes_per_token"] == 64 * 1024 + 1024
    assert 76_000 <= data["kv_cache_tokens"] <= 92_000
    assert 9 <= data["max_concurrency"] <= 11


def test_per_tensor_scales_reproduce_the_seeds_fp8_row_and_say_so(capsys):
    status = main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--kv-cache-dtype", "fp8", "--kv-scales",
                   "per-tensor", "--max-model-len", "8192"])
    out = capsys.readouterr().out
    assert status == 0
    assert "2 (K, V) × 32 layers × 8 KV heads × 128 head_dim × 1 B (fp8) = 65,536 B = 64 KiB" in out
    assert "fp8, per-tensor scales: one scale per layer for K and one for V, no bytes per token" in out
    assert ("KV cache (fp8, per-tensor scales): 5,265 blocks × 16 tokens = 84,240 tokens, 5.14 GiB (64.0 KiB/token); "
            "maximum concurrency for 8,192 tokens per request: 10.28x") in out


def test_default_scales_are_kvserves_own_and_say_so(capsys):
    status = main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--kv-cache-dtype", "fp8", "--max-model-len", "8192"])
    out = capsys.readouterr().out
    assert status == 0
    assert "(128 head_dim × 1 B (fp8) + 2 B scale) = 66,560 B = 65 KiB" in out
    assert "fp8, per-token-head scales (kvserve's own storage)" in out and "--kv-scales per-tensor" in out
    assert "KV cache (fp8, per-token-head scales): 5,184 blocks × 16 tokens = 82,944 tokens" in out


@pytest.mark.parametrize("scales, per_token", [("per-token-head", 65 * 1024), ("per-tensor", 64 * 1024)])
def test_json_names_the_scales_it_computed(capsys, scales, per_token):
    _, data = plan_json(capsys, "llama-3.1-8b", "--kv-cache-dtype", "int8", "--kv-scales", scales)
    assert (data["kv_scales"], data["kv_bytes_per_token"]) == (scales, per_token)
    assert plan_json(capsys, "llama-3.1-8b")[1]["kv_scales"] == "none"  # bf16


def test_weights_and_overhead_overrides_move_the_budget(capsys):
    _, data = plan_json(capsys, "llama-3.1-8b", "--gpu-memory", "24GiB", "--gpu-memory-utilization", "1",
                        "--weights-gib", "10", "--overhead-gib", "2")
    assert data["weights_bytes"] == 10 * GiB
    assert data["kv_budget_bytes"] == 12 * GiB
    assert data["kv_cache_tokens"] == 12 * GiB // (128 * 1024)


def test_custom_contexts(capsys):
    _, data = plan_json(capsys, "qwen3-8b", "--context", "1000", "4000")
    assert [r["tokens"] for r in data["per_request"]] == [1_000, 4_000]
    assert data["kv_budget_bytes"] is None and data["fits"] is None  # no GPU given


def test_conversation_json(capsys):
    status, data = plan_json(capsys, "llama-3.1-8b", "--conversation", "--first", "1200", "--question", "200",
                             "--answer", "500", "--turns", "10")
    assert status == 0
    assert len(data["turns"]) == 10
    assert data["final_tokens"] == 8_000
    assert data["final_kv_bytes"] == 1_000 * MiB
    assert data["prefill_tokens_without_prefix_cache"] == 43_500
    assert data["new_input_tokens"] == 3_000
    assert data["prefill_tokens_with_prefix_cache"] == 3_052


def test_conversation_table(capsys):
    main(["plan", "llama-3.1-8b", "--conversation"])
    out = capsys.readouterr().out
    assert "43,500 tokens prefilled for 3,000 new input tokens (14.5×)" in out
    assert "1,000.00 MiB" in out


def test_gguf_file_json(capsys):
    status, data = plan_json(capsys, str(embedded_gguf_path()), "--gpu-memory", "2GiB")
    assert status == 0
    assert data["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # llama.cpp's f16 cache
    assert data["max_model_len"] == 8_192
    assert data["fits"] is True
    assert [r["tokens"] for r in data["per_request"]] == [2_048, 8_192]


def test_hybrid_json_reports_its_fixed_state(capsys):
    _, data = plan_json(capsys, "qwen3-next-80b-a3b", "--gpu", "h200", "--weights-dtype", "fp8")
    assert data["kv_bytes_per_token"] == 2 * 12 * 2 * 256 * 2
    assert data["fixed_state_bytes_per_request"] > 0
    assert data["fits"] is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no-such-model"], "unknown model 'no-such-model'"),
        (["llama-3.1-8b", "--gpu", "rtx-9999"], "unknown GPU 'rtx-9999'"),
        (["llama-3.1-8b", "--gpu-memory=-24GiB"], "must be positive"),
        (["llama-3.1-8b", "--gpu-memory", "lots"], "cannot read memory size"),
        (["llama-3.1-8b", "--gpu", "h100", "--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization"),
        (["llama-3.1-8b", "--max-model-len", "200000"], "maximum length 131,072"),
        (["llama-3.1-8b", "--gpu", "h100", "--weights-gib", "-1"], "--weights-gib must not be negative"),
        (["llama-3.1-8b", "--block-size", "0"], "--block-size must be at least 1"),
        (["qwen3-next-80b-a3b", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["llama-3.1-8b", "--conversation", "--turns", "0"], "--turns must be at least 1"),
        (["llama-3.1-8b", "--kv-scales", "per-tensor"], "--kv-scales per-tensor applies to fp8, fp8_e5m2 and int8; "
                                                        "bf16 keeps no scales"),
        (["llama-3.1-8b", "--kv-cache-dtype", "int4", "--kv-scales", "per-tensor"], "int4 keeps per-channel keys"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_malformed_config_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 4}')
    assert main(["plan", str(path)]) == 2
    assert "missing num_attention_heads" in capsys.readouterr().err


def test_help_documents_the_default_overhead(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "1.5 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("text, expected", [("24GiB", 24 * GiB), ("24", 24 * GiB), ("80GB", 80 * 10**9),
                                            ("512MiB", 512 * MiB), ("1.5g", 3 * GiB // 2)])
def test_memory_sizes(text, expected):
    assert parse_memory_size(text) == expected


def test_plot_draws_the_plan_and_a_bad_plot_fails_before_planning(capsys, tmp_path):
    out = tmp_path / "plan.svg"
    status, data = plan_json(capsys, "llama-3.1-8b", "--gpu", "rtx-4090", "--max-model-len", "8192", "--plot", str(out))
    assert status == 0 and data["fits"] is True  # stdout still holds only the JSON
    kind, width_pt, height_pt = image_size(out)
    assert (kind, width_pt, height_pt) == ("svg", 11 * 72, pytest.approx(4.2 * 72))
    drawn = out.read_text()
    for words in ("GPU memory", "bf16, 128 KiB/token", "fp8, ", "int8, ", "int4, ", "max_model_len 8,192"):
        assert words in drawn
    assert main(["plan", "llama-3.1-8b", "--plot", str(tmp_path / "plan.png")]) == 2
    assert "--plot draws the GPU memory split" in capsys.readouterr().err
    assert main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--plot", str(tmp_path / "no" / "plan.png")]) == 2
    assert f"the directory {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "plan.png").exists()


def test_plot_with_per_tensor_scales_draws_fp8_and_int8_at_64_kib(capsys, tmp_path):
    out = tmp_path / "plan.svg"
    status = main(["plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--max-model-len", "8192", "--kv-cache-dtype", "fp8",
                   "--kv-scales", "per-tensor", "--plot", str(out)])
    assert status == 0
    drawn = out.read_text()
    for words in ("bf16, 128 KiB/token", "fp8 per-tensor, 64 KiB/token", "int8 per-tensor, 64 KiB/token", "int4, "):
        assert words in drawn
    assert "fp8, 65 KiB/token" not in drawn


def test_streaming_eviction_makes_concurrency_independent_of_length(capsys):
    plans = [plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80", "--max-model-len", str(n), "--kv-eviction",
                       "streaming", "--kv-sink-tokens", "4", "--kv-recent-tokens", "1024")[1] for n in (8192, 131072)]
    assert plans[0]["max_blocks_per_request"] == 1 + 64 + 1
    assert plans[0]["max_concurrency"] == plans[1]["max_concurrency"]
    assert plans[0]["max_concurrency"] == pytest.approx(plans[0]["num_blocks"] / 66)
    without = plan_json(capsys, "llama-3.1-8b", "--gpu", "h100-80", "--max-model-len", "131072")[1]
    assert without["max_concurrency"] < plans[1]["max_concurrency"] / 100
