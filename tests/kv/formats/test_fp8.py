"""The fp8 read path (float16 bit patterns, kvserve/kv/formats/fp8.py) gives exactly what a plain float8 cast
times the scale gives, for every finite code, both fp8 kinds and every model dtype."""
import pytest
import torch

from kvserve.kv.formats.fp8 import Fp8KVCache
from kvserve.planner.layout import KVLayout


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_equals_a_plain_cast_times_the_scale(fp8_dtype, dtype):
    cache = Fp8KVCache(KVLayout.uniform(1), 1, 16, 1, 256, dtype=dtype, fp8_dtype=fp8_dtype)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(codes.view(fp8_dtype).float())
    data = codes[finite].view(1, 1, -1)
    scales = torch.tensor([[1.0], [3.0e-3], [7.5]], dtype=torch.bfloat16).view(3, 1)
    for scale in scales:
        expected = data.view(fp8_dtype).to(dtype) * scale.to(dtype)[..., None]
        assert torch.equal(cache.dequantize(data, scale.view(1, 1)), expected)
