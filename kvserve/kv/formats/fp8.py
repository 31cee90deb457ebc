"""FP8 KV cache (E4M3 or E5M2) with one bfloat16 scale per token and KV head (scale = absmax / format max).

A fixed per-layer scale of 1.0 leaves keys with large outliers to saturate; a dynamic per-token-head scale uses
the format's full range for every vector. Values are clamped to the format's range before the cast, so nothing
becomes inf or NaN. The elements are kept as raw bytes (uint8): CPU indexing kernels do not take float8 types.

K and V are stored rotated by a normalized Hadamard matrix (`rotation`): it spreads each vector's energy over
all its channels, which halved E4M3's perplexity cost on SmolLM2 (docs/quality.md). Nothing is rotated back on
the read: attention rotates its queries the same way (q·k is unchanged by an orthogonal rotation) and its output
back (the attention-weighted sum of rotated values is the rotated sum), a cost per query, not per cached token.

Unlike int8 and int4, fp8 attends eagerly: compiled the same way (formats.compiled), its float8 -> float32
widening came out scalar and the decode-heavy bench fell from about 0.8x to 0.53x of `auto`
(docs/benchmarks.md)."""
from __future__ import annotations

import torch

from kvserve.kv.formats.per_token import PerTokenQuantizedKVCache, absmax_scale
from kvserve.rotation import hadamard


class Fp8KVCache(PerTokenQuantizedKVCache):
    storage_dtype = torch.uint8

    def __init__(self, *args, fp8_dtype: torch.dtype = torch.float8_e4m3fn, **kwargs):
        self.fp8_dtype = fp8_dtype
        self.fp8_max = torch.finfo(fp8_dtype).max
        self.format_name = "fp8_e4m3" if fp8_dtype == torch.float8_e4m3fn else "fp8_e5m2"
        super().__init__(*args, **kwargs)
        self.rotation = hadamard(self.head_dim).to(dtype=self.dtype, device=self.device)

    def describe(self) -> str:
        return f"{self.format_name}, per-token-head scales, Hadamard-rotated"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tiles.map(lambda t: t.to(self.dtype) @ self.rotation, x)
        scale = absmax_scale(x, self.fp8_max)
        scaled = (x.float() / scale.float()[..., None]).clamp_(-self.fp8_max, self.fp8_max)
        return scaled.to(self.fp8_dtype).view(torch.uint8), scale

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # The bytes become float16 bit patterns (fast to widen on a CPU; PyTorch's own float8 conversion is scalar
        # there, about 4x slower per read): e5m2 is a float16's top byte; e4m3's sign, exponent and mantissa
        # shift into place and read 2^-8 too small (float16's exponent bias is 15, e4m3's 7), which the scale
        # absorbs. Every product is exact in float32 and rounded once, so the values are those of a plain cast.
        # Sign-extending (int8 -> int16) puts the sign in bit 15 with one shift; e4m3 then clears bit 14, where
        # the extension also landed. In place on the one int16 tensor: a read is four passes over it.
        codes = data.view(torch.int8).to(torch.int16)
        if self.fp8_dtype == torch.float8_e5m2:
            codes <<= 8
            factor = 1.0
        else:
            codes <<= 7
            codes &= ~0x4000  # 0b1011_1111_1000_0000: sign, then e4m3's 4 exponent and 3 mantissa bits
            factor = 256.0
        return codes.view(torch.float16).float().mul_(scale.float()[..., None] * factor).to(self.dtype)
