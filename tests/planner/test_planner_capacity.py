"""GPU budget → blocks, tokens and concurrency; the refusal; the engine's start-up line."""
import pytest
import torch

from kvserve.kv.formats import make_kv_cache
from kvserve.planner.capacity import DEFAULT_OVERHEAD_BYTES, MemoryBudget, plan_kv_cache
from kvserve.planner.kv_size import kv_layout
from kvserve.planner.gpus import gpu_memory_bytes
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.units import GiB
from kvserve.planner.weights import weights_bytes


def rtx_4090_plan(model: str = "llama-3.1-8b", kv_cache_dtype: str = "bf16", max_model_len: int | None = None,
                  kv_scales: str = "per-token-head", overhead_bytes: int = DEFAULT_OVERHEAD_BYTES):
    spec = load_model_spec(model)
    budget = MemoryBudget(gpu_memory_bytes("rtx-4090"), 0.9, weights_bytes(spec, "bf16"), overhead_bytes)
    return plan_kv_cache(spec, budget.kv_budget_bytes, 16, kv_cache_dtype, max_model_len, kv_scales=kv_scales)


def test_weights_of_llama_3_1_in_bf16():
    assert round(weights_bytes(load_model_spec("llama-3.1-8b"), "bf16") / GiB) == 15
    assert round(weights_bytes(load_model_spec("llama-3.1-70b"), "bf16") / GiB) == 131


def test_weights_follow_the_weights_dtype():
    spec = load_model_spec("llama-3.1-8b")
    assert weights_bytes(spec, "fp8") * 2 == weights_bytes(spec, "bf16")
    with pytest.raises(ValueError, match="unknown weights dtype 'fp6'"):
        weights_bytes(spec, "fp6")


def test_8b_on_a_4090_holds_38k_to_46k_tokens_in_whole_blocks():
    plan = rtx_4090_plan()
    assert 38_000 <= plan.kv_cache_tokens <= 46_000
    assert plan.kv_cache_tokens % 16 == 0
    assert plan.kv_cache_bytes <= plan.kv_budget_bytes < plan.kv_cache_bytes + plan.block_bytes


def test_8b_on_a_4090_refuses_its_full_131072_context():
    plan = rtx_4090_plan()
    assert plan.max_model_len == 131_072
    assert not plan.fits
    assert plan.max_concurrency < 1
    assert "131,072" in plan.error  # the model's max length
    assert f"holds {plan.kv_cache_tokens:,} tokens" in plan.error
    assert f"largest max_model_len that fits is {plan.kv_cache_tokens:,}" in plan.error
    assert "--max-model-len" in plan.error and "--gpu-memory-utilization" in plan.error


def test_8b_on_a_4090_at_8192_serves_about_five_requests():
    plan = rtx_4090_plan(max_model_len=8_192)
    assert plan.fits and plan.error is None
    assert 4.5 <= plan.max_concurrency <= 5.6


def test_fp8_kv_on_a_4090_about_doubles_tokens_and_concurrency():
    plan = rtx_4090_plan(kv_cache_dtype="fp8", max_model_len=8_192)
    assert plan.kv_bytes_per_token == 64 * 1024 + 1024  # plus an fp16 scale per head vector
    assert 76_000 <= plan.kv_cache_tokens <= 92_000
    assert 9 <= plan.max_concurrency <= 11


@pytest.mark.parametrize("overhead_gib", [1, 1.5, 2])
def test_per_tensor_fp8_on_a_4090_gives_the_seeds_76k_to_92k_tokens_and_9_to_11_requests(overhead_gib):
    """The seed's ranges are bf16's 38K-46K doubled: overheads of 1-2 GiB span them; the default is in the middle."""
    overhead = round(overhead_gib * GiB)
    bf16 = rtx_4090_plan(max_model_len=8_192, overhead_bytes=overhead)
    fp8 = rtx_4090_plan(kv_cache_dtype="fp8", max_model_len=8_192, kv_scales="per-tensor", overhead_bytes=overhead)
    assert fp8.kv_bytes_per_token == 64 * 1024
    assert 38_000 <= bf16.kv_cache_tokens <= 46_500 and 76_000 <= fp8.kv_cache_tokens <= 92_500  # 92,432 is "92K"
    assert 2 * bf16.kv_cache_tokens <= fp8.kv_cache_tokens < 2 * bf16.kv_cache_tokens + 2 * 16  # whole blocks
    assert 9 <= int(fp8.max_concurrency) <= 11
    assert fp8.summary_line("fp8, per-tensor scales").startswith("KV cache (fp8, per-tensor scales): ")


def test_per_token_head_fp8_holds_fewer_tokens_than_per_tensor():
    per_tensor = rtx_4090_plan(kv_cache_dtype="fp8", kv_scales="per-tensor")
    per_token_head = rtx_4090_plan(kv_cache_dtype="fp8")
    assert (per_tensor.kv_cache_tokens, per_token_head.kv_cache_tokens) == (84_240, 82_944)  # docs/planner.md


def test_concurrency_rounds_each_request_up_to_whole_blocks():
    spec = ModelSpec.from_hf_config(_tiny_config())  # 1 KiB/token in fp32, 16 KiB blocks
    plan = plan_kv_cache(spec, 10 * 16 * 1024, 16, "fp32", max_model_len=20)  # 10 blocks; 20 tokens need 2
    assert plan.num_blocks == 10
    assert plan.max_concurrency == 5.0


def test_largest_fitting_length_of_a_sliding_window_model_counts_the_window():
    spec = load_model_spec("gemma-3-27b")
    plan = plan_kv_cache(spec, 4 * GiB, 16, "bf16")
    fit = plan.max_fitting_len
    assert not plan.fits
    assert plan.request_bytes(fit) <= plan.kv_cache_bytes < plan.request_bytes(fit + 16)
    assert fit > plan.kv_cache_tokens  # the 1,024-token windows free room for longer requests


def test_summary_line_format():
    spec = ModelSpec.from_hf_config(_tiny_config(num_hidden_layers=15, num_key_value_heads=4, head_dim=64,
                                                 max_position_embeddings=8_192))
    plan = plan_kv_cache(spec, 4_096 * 16 * 30 * 1024, 16, "fp32", 8_192)  # 30 KiB/token in fp32
    assert plan.summary_line() == (
        "KV cache: 4,096 blocks × 16 tokens = 65,536 tokens, 1.88 GiB (30.0 KiB/token); "
        "maximum concurrency for 8,192 tokens per request: 8.00x"
    )


@pytest.mark.parametrize("kv_format", ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
                                       "nuq4", "nuq3", "nuq3k4v"])
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-27b"])
def test_plan_matches_the_storage_the_engine_allocates(kv_format, model):
    spec = load_model_spec(model)
    plan = plan_kv_cache(spec, 64 * 1024 * 1024 + 123, 16, kv_format, 2_048)
    cache = make_kv_cache(kv_format, kv_layout(spec), plan.num_blocks, plan.block_size, spec.num_kv_heads,
                          spec.head_dim, torch.float32)
    assert cache.nbytes == plan.kv_cache_bytes == plan.num_blocks * plan.block_bytes
    key_bits = {"int4": 4, "nuq4": 4, "nuq3": 3, "nuq3k4v": 3}.get(kv_format, 8)  # packed across a block's tokens
    assert cache.k.shape[1] * 8 == plan.num_blocks * plan.block_size * key_bits
    if model == "smollm2-135m":  # one group of every layer: a block is 16 tokens of the whole model
        assert cache.nbytes == plan.kv_bytes_per_token * plan.kv_cache_tokens
    else:  # 52 sliding and 10 full layers: groups of gcd(52, 10) = 2 layers
        assert cache.num_layers == plan.layers_per_block == 2


def test_max_model_len_defaults_to_the_model_and_cannot_exceed_it():
    spec = ModelSpec.from_hf_config(_tiny_config())
    assert plan_kv_cache(spec, 1 << 20, 16, "fp32").max_model_len == 512
    with pytest.raises(ValueError, match="maximum length 512"):
        plan_kv_cache(spec, 1 << 20, 16, "fp32", 513)


def test_negative_budget_and_bad_block_size_are_refused():
    spec = ModelSpec.from_hf_config(_tiny_config())
    with pytest.raises(ValueError, match="must not be negative"):
        plan_kv_cache(spec, -1)
    with pytest.raises(ValueError, match="block_size"):
        plan_kv_cache(spec, 1 << 20, 0)


def test_zero_budget_explains_that_nothing_fits():
    plan = plan_kv_cache(ModelSpec.from_hf_config(_tiny_config()), 0, 16, "fp32")
    assert not plan.fits and plan.num_blocks == 0
    assert "largest max_model_len that fits is 0" in plan.error


def test_weights_larger_than_the_gpu_leave_no_kv_budget():
    spec = load_model_spec("llama-3.1-70b")
    budget = MemoryBudget(gpu_memory_bytes("rtx-4090"), 0.9, weights_bytes(spec, "bf16"))
    assert budget.kv_budget_bytes == 0
    assert "leave no memory for the KV cache" in budget.error


@pytest.mark.parametrize("memory, utilization", [(0, 0.9), (-GiB, 0.9), (GiB, 0), (GiB, 1.5)])
def test_memory_budget_rejects_bad_input(memory, utilization):
    with pytest.raises(ValueError):
        MemoryBudget(memory, utilization, 0)


def _tiny_config(**overrides) -> dict:
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 100,
              "max_position_embeddings": 512, "torch_dtype": "float32"}
    return {**config, **overrides}
