"""INT8 KV cache: symmetric, one bfloat16 scale per token and KV head (scale = absmax / 127)."""
from __future__ import annotations

import torch

from kvserve.kv.formats.per_token import PerTokenQuantizedKVCache, absmax_scale

INT8_MAX = 127


class Int8KVCache(PerTokenQuantizedKVCache):
    format_name = "int8"
    storage_dtype = element_dtype = torch.int8

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = absmax_scale(x, INT8_MAX)
        q = (x.float() / scale.float()[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX)
        return q.to(torch.int8), scale

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return data.to(self.dtype).mul_(scale.to(self.dtype)[..., None])  # in place: one float pass fewer
