"""KV bytes per token and per request: the seed articles' numbers, attention kinds, quantized formats."""
import pytest

from kvserve.planner.kv_size import (
    KV_DTYPES,
    fixed_state_bytes,
    kv_bytes_per_token,
    request_kv_bytes,
    resolve_kv_dtype,
)
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.units import GiB, KiB, MiB


def per_token(model: str, dtype: str = "auto") -> int:
    spec = load_model_spec(model)
    return kv_bytes_per_token(spec, resolve_kv_dtype(dtype, spec))


def per_request(model: str, tokens: int, dtype: str = "auto") -> int:
    spec = load_model_spec(model)
    return request_kv_bytes(spec, resolve_kv_dtype(dtype, spec), tokens, block_size=16)


def test_llama_3_1_bytes_per_token_in_bf16():
    assert per_token("llama-3.1-8b") == 128 * KiB
    assert per_token("llama-3.1-70b") == 320 * KiB


@pytest.mark.parametrize(
    "tokens, gib_8b, gib_70b",
    [(2_048, 0.25, 0.625), (8_192, 1, 2.5), (32_768, 4, 10), (131_072, 16, 40)],  # the seed prints 0.625 as 0.63
)
def test_per_request_sizes_of_the_seed_table(tokens, gib_8b, gib_70b):
    assert per_request("llama-3.1-8b", tokens) == gib_8b * GiB
    assert per_request("llama-3.1-70b", tokens) == gib_70b * GiB


def test_llama_3_8b_4096_tokens_batch_1_is_536_mb():
    assert per_request("llama-3.1-8b", 4_096, "fp16") == 536_870_912


def test_fp8_pays_one_fp16_scale_per_head_vector():
    # 2 (K, V) × 32 layers × 8 heads × (128 × 1 B + 2 B): dynamic per-token-head scales, as the engine stores them
    assert per_token("llama-3.1-8b", "fp8") == 64 * KiB + 2 * 32 * 8 * 2
    assert per_token("llama-3.1-8b", "fp8_e5m2") == 64 * KiB + 2 * 32 * 8 * 2


def test_per_tensor_scales_halve_bf16_exactly():
    # the seed's 4090 example: one scale per layer (vLLM's FP8 cache) adds nothing per token, 128 KiB -> 64 KiB
    spec = load_model_spec("llama-3.1-8b")
    for name in ("fp8", "fp8_e5m2", "int8"):
        dtype = resolve_kv_dtype(name, spec, "per-tensor")
        assert dtype.scales == "per-tensor"
        assert kv_bytes_per_token(spec, dtype) == 64 * KiB == per_token("llama-3.1-8b", "bf16") // 2


def test_per_token_head_scales_are_the_default_and_the_engines_storage():
    spec = load_model_spec("llama-3.1-8b")
    default = resolve_kv_dtype("fp8", spec)
    assert default == resolve_kv_dtype("fp8", spec, "per-token-head")
    assert default.scales == "per-token-head"
    assert kv_bytes_per_token(spec, default) == 65 * KiB


@pytest.mark.parametrize("dtype, message", [("bf16", "bf16 keeps no scales"), ("auto", "bf16 keeps no scales"),
                                            ("int4", "int4 keeps per-channel keys, per-token-head values scales")])
def test_per_tensor_scales_are_refused_where_they_do_not_apply(dtype, message):
    with pytest.raises(ValueError, match="--kv-scales per-tensor applies to fp8, fp8_e5m2 and int8; " + message):
        resolve_kv_dtype(dtype, load_model_spec("llama-3.1-8b"), "per-tensor")


def test_unknown_kv_scales_are_refused():
    with pytest.raises(ValueError, match="unknown kv scales 'per-block'"):
        resolve_kv_dtype("fp8", load_model_spec("llama-3.1-8b"), "per-block")


def test_fp32_doubles_bf16():
    assert per_token("llama-3.1-8b", "fp32") == 256 * KiB


def test_int8_pays_one_fp16_scale_per_head_vector():
    # 2 (K, V) × 32 layers × 8 heads × (128 × 1 B + 2 B)
    assert per_token("llama-3.1-8b", "int8") == 64 * KiB + 2 * 32 * 8 * 2


def test_int4_pays_per_channel_key_scales_per_block_and_per_token_value_scales():
    # 32 layers × 8 heads × (K: 128 × 0.5 B + 128 channels × (2 + 2) B / 16 tokens; V: 128 × 0.5 B + (2 + 2) B)
    assert per_token("llama-3.1-8b", "int4") == 32 * 8 * ((64 + 32) + (64 + 4))


def test_int4_key_scales_shrink_per_token_with_bigger_blocks_and_must_divide_evenly():
    spec = load_model_spec("llama-3.1-8b")
    assert kv_bytes_per_token(spec, KV_DTYPES["int4"], 32) == 32 * 8 * ((64 + 16) + (64 + 4))
    with pytest.raises(ValueError, match="block_size 1024 must divide 512"):
        kv_bytes_per_token(spec, KV_DTYPES["int4"], 1024)


def test_auto_follows_the_config_dtype():
    spec = ModelSpec.from_hf_config(_config(torch_dtype="float32"))
    assert resolve_kv_dtype("auto", spec).name == "fp32"
    assert resolve_kv_dtype("auto", load_model_spec("llama-3.1-8b")).name == "bf16"


def test_unknown_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown kv cache dtype 'fp6'"):
        resolve_kv_dtype("fp6", load_model_spec("llama-3.1-8b"))


def test_mla_caches_the_latent_and_rope_key_once_per_layer():
    # DeepSeek-V2-Lite: 27 layers × (512 + 64) × 2 B, however many heads it has
    assert per_token("deepseek-v2-lite") == 27 * 576 * 2


def test_mha_without_head_dim_uses_hidden_over_heads():
    spec = ModelSpec.from_hf_config(_config(num_key_value_heads=None, head_dim=None))
    assert spec.attention_kind == "MHA"
    assert kv_bytes_per_token(spec, resolve_kv_dtype("bf16", spec)) == 2 * 4 * 8 * 32 * 2


def test_mqa_keeps_one_kv_head():
    spec = ModelSpec.from_hf_config(_config(num_key_value_heads=1))
    assert spec.attention_kind == "MQA"
    assert kv_bytes_per_token(spec, resolve_kv_dtype("bf16", spec)) == 2 * 4 * 1 * 32 * 2


def test_sliding_window_layers_stop_growing_at_the_window():
    # Mistral 7B v0.1: every layer slides over 4,096 tokens
    assert per_request("mistral-7b-v0.1", 2_048) == 256 * MiB
    assert per_request("mistral-7b-v0.1", 4_096) == 512 * MiB
    assert per_request("mistral-7b-v0.1", 32_768) == 512 * MiB


def test_sliding_window_rounds_up_to_whole_blocks():
    spec = ModelSpec.from_hf_config(_config(sliding_window=100))  # 7 blocks of 16 = 112 tokens
    dtype = resolve_kv_dtype("bf16", spec)
    assert request_kv_bytes(spec, dtype, 1_000, 16) == 112 * kv_bytes_per_token(spec, dtype)


def test_gemma_3_local_layers_are_capped_and_global_layers_grow():
    # 62 layers, 5 local (1,024-token window) per global: 52 local + 10 global, 16 KV heads × 128 × 2 × 2 B
    per_layer = 2 * 16 * 128 * 2
    expected = (10 * 131_072 + 52 * 1_024) * per_layer
    assert per_request("gemma-3-27b", 131_072) == expected
    assert per_request("gemma-3-27b", 1_024) == 62 * 1_024 * per_layer


def test_seed_004_hybrid_counts_only_its_attention_layers():
    # 40 layers, every 4th full attention: 10 × 8 KV heads × 128 × 2 B × 2 (K, V)
    spec = ModelSpec.from_hf_config(_hybrid_config())
    dtype = resolve_kv_dtype("fp16", spec)
    assert kv_bytes_per_token(spec, dtype) == 40 * KiB
    assert request_kv_bytes(spec, dtype, 32_768, 16) == 1.25 * GiB


def test_hybrid_fixed_state_is_reported_separately():
    spec = load_model_spec("qwen3-next-80b-a3b")
    # 36 gated-DeltaNet layers: 32 value heads × 128 × 128 recurrent + 3 × (2 × 16 × 128 + 32 × 128) conv, in float32
    # as the engine keeps it (the plan reports what the engine allocates)
    assert spec.layer_kinds.count("linear") == 36
    assert fixed_state_bytes(spec) == 36 * (32 * 128 * 128 + 3 * 8_192) * 4
    assert per_token("qwen3-next-80b-a3b") == 2 * 12 * 2 * 256 * 2


def test_hybrid_without_state_sizes_reports_no_state():
    assert fixed_state_bytes(ModelSpec.from_hf_config(_hybrid_config())) == 0


def _config(**overrides) -> dict:
    config = {
        "model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000,
        "max_position_embeddings": 2_048, "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return {key: value for key, value in config.items() if value is not None}


def _hybrid_config() -> dict:
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10
    return _config(num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                   hidden_size=2048, max_position_embeddings=262_144, layer_types=layer_types,
                   torch_dtype="float16")
