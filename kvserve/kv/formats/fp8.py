"""FP8 KV cache (E4M3 or E5M2) with one bfloat16 scale per token and KV head (scale = absmax / format max).

A fixed per-layer scale of 1.0 leaves keys with large outliers to saturate; a dynamic per-token-head scale uses
the format's full range for every vector. Values are clamped to the format's range before the cast, so nothing
becomes inf or NaN. The elements are kept as raw bytes (uint8): CPU indexing kernels do not take float8 types."""
from __future__ import annotations

import torch

from kvserve.kv.formats.per_token import PerTokenQuantizedKVCache, absmax_scale


class Fp8KVCache(PerTokenQuantizedKVCache):
    storage_dtype = torch.uint8

    def __init__(self, *args, fp8_dtype: torch.dtype = torch.float8_e4m3fn, **kwargs):
        self.fp8_dtype = fp8_dtype
        self.fp8_max = torch.finfo(fp8_dtype).max
        self.format_name = "fp8_e4m3" if fp8_dtype == torch.float8_e4m3fn else "fp8_e5m2"
        super().__init__(*args, **kwargs)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = absmax_scale(x, self.fp8_max)
        scaled = (x.float() / scale.float()[..., None]).clamp_(-self.fp8_max, self.fp8_max)
        return scaled.to(self.fp8_dtype).view(torch.uint8), scale

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return data.view(self.fp8_dtype).to(self.dtype).mul_(scale.to(self.dtype)[..., None])  # in place: one pass fewer
