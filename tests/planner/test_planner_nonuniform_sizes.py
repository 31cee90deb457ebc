"""Bytes per token of the non-uniform formats (nuq4, nuq3, nuq3k4v): codes for K and V, one fp16 scale per value
vector, and per key channel per block an fp16 midpoint and a half range (fp16 for nuq4, 1 byte for the
others); nuq3 holds at least 1.3x int4's tokens, nuq3k4v 1.2x, nuq4 no fewer; --kv-scales per-tensor does not apply
to them."""
import pytest

from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.report import kv_formula, kv_notes


@pytest.mark.parametrize("dtype, key_bits, value_bits, key_channel_bytes",
                         [("nuq4", 4, 4, 2 + 2), ("nuq3", 3, 3, 2 + 1), ("nuq3k4v", 3, 4, 2 + 1)])
def test_bytes_per_token_are_codes_value_scales_and_key_channel_statistics_per_block(dtype, key_bits, value_bits,
                                                                                    key_channel_bytes):
    spec = load_model_spec("smollm2-135m")  # 30 layers, 3 KV heads of 64
    kv = resolve_kv_dtype(dtype, spec)
    for block_size in (16, 32):
        key, value = 64 * key_bits // 8 + 64 * key_channel_bytes // block_size, 64 * value_bits // 8 + 2
        assert kv_bytes_per_token(spec, kv, block_size) == 30 * 3 * (key + value)
    assert f"64 channels × {key_channel_bytes} B scale + zero point / 16-token block" in kv_formula(spec, kv, 16)
    assert "2 B scale" in kv_formula(spec, kv, 16)
    assert any("stays in full precision" in note for note in kv_notes(spec, kv, 16))


def test_nuq3_holds_at_least_1_3x_the_tokens_of_int4_and_nuq4_no_fewer():
    spec = load_model_spec("smollm2-135m")
    int4, nuq4, nuq3, mixed = (kv_bytes_per_token(spec, resolve_kv_dtype(d, spec))
                               for d in ("int4", "nuq4", "nuq3", "nuq3k4v"))
    assert int4 / nuq3 >= 1.3 and nuq4 <= int4 and int4 / mixed >= 1.2


@pytest.mark.parametrize("dtype", ["nuq4", "nuq3", "nuq3k4v"])
def test_per_tensor_scales_are_refused(dtype):
    with pytest.raises(ValueError, match=f"applies to fp8, fp8_e5m2 and int8; {dtype} keeps per-channel keys"):
        resolve_kv_dtype(dtype, load_model_spec("smollm2-135m"), "per-tensor")
