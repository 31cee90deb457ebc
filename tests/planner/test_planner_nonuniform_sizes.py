"""Bytes per token of the non-uniform formats (nuq4, nuq3): codes plus one fp16 scale per head vector, for K and V
alike; nuq3 holds at least 1.3x int4's tokens; --kv-scales per-tensor does not apply to them."""
import pytest

from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.report import kv_formula


@pytest.mark.parametrize("dtype, vector_bytes", [("nuq4", 64 * 4 // 8 + 2), ("nuq3", 64 * 3 // 8 + 2)])
def test_bytes_per_token_are_codes_and_one_scale_per_head_vector(dtype, vector_bytes):
    spec = load_model_spec("smollm2-135m")  # 30 layers, 3 KV heads of 64
    kv = resolve_kv_dtype(dtype, spec)
    assert kv_bytes_per_token(spec, kv) == 2 * 30 * 3 * vector_bytes
    assert kv_bytes_per_token(spec, kv, block_size=32) == kv_bytes_per_token(spec, kv)  # nothing per block
    assert "2 B scale" in kv_formula(spec, kv, 16)


def test_nuq3_holds_at_least_1_3x_the_tokens_of_int4_and_nuq4_no_fewer():
    spec = load_model_spec("smollm2-135m")
    int4, nuq4, nuq3 = (kv_bytes_per_token(spec, resolve_kv_dtype(d, spec)) for d in ("int4", "nuq4", "nuq3"))
    assert int4 / nuq3 >= 1.3 and nuq4 <= int4


@pytest.mark.parametrize("dtype", ["nuq4", "nuq3"])
def test_per_tensor_scales_are_refused(dtype):
    with pytest.raises(ValueError, match=f"applies to fp8, fp8_e5m2 and int8; {dtype} keeps per-token-head scales"):
        resolve_kv_dtype(dtype, load_model_spec("smollm2-135m"), "per-tensor")
