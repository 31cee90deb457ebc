"""INT8 KV cache: symmetric, one bfloat16 scale per token and KV head (scale = absmax / 127). Its decode attention
is compiled (formats.compiled)."""
from __future__ import annotations

import torch

from kvserve.kv.formats.compiled import CompiledFunction, attend, decode_kind, warm_up_decode
from kvserve.kv.formats.per_token import PerTokenQuantizedKVCache, absmax_scale

INT8_MAX = 127


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectors [..., dim] -> int8 codes and their bfloat16 scales [...] (absmax / 127); per-head streams store the
    same (kv/head_streams.py)."""
    scale = absmax_scale(x, INT8_MAX)
    q = (x.float() / scale.float()[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.to(dtype).mul_(scale.to(dtype)[..., None])  # in place: one float pass fewer


class Int8KVCache(PerTokenQuantizedKVCache):
    format_name = "int8"
    storage_dtype = torch.int8

    def __init__(self, *args, compile: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.attend_decodes_with(fused_decode_attention(self.block_size) if compile else None)

    def describe(self) -> str:
        return f"{super().describe()}; {decode_kind(self.fused_decode)} decode attention"

    def warm_up(self, num_query_heads: int) -> None:
        if self.fused_decode is not None:
            warm_up_decode(self, self.fused_decode, num_query_heads, extra_keys=0)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(x)

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(data, scale, self.dtype)

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        """Over the stored blocks alone: the new token was written, and is read back, like every other."""
        N = self.num_blocks
        args = (queries, self.k[row].view(N, -1), self.k_scale[row].view(N, -1), self.v[row].view(N, -1),
                self.v_scale[row].view(N, -1), block_tables, mask)
        dynamic = [(t, 0) for t in args] + [(block_tables, 1), (mask, 3)] if self.fused_decode.warming else ()
        return self.fused_decode(args, dynamic)


def fused_decode_attention(block_size: int) -> CompiledFunction:
    """Decode attention over the stored int8 elements (see formats.compiled): selecting, widening and scaling them
    and attending become a few generated loops, the block size a constant of them. Each cache gets its own (a
    failure to compile is that engine's); the graphs are saved whole, named by the block size, so a later cache of
    the same shapes, in this process or a later one, compiles nothing."""
    def dequantize(data: torch.Tensor, scale: torch.Tensor, block_tables: torch.Tensor, heads: int,
                   dim: int) -> torch.Tensor:
        S, B = block_tables.shape
        n, blocks = S * B, block_tables.reshape(-1)  # sizes as products: no symbolic divisions
        x = data.index_select(0, blocks).float().view(n, block_size, heads, dim)
        x = x * scale.index_select(0, blocks).float().view(n, block_size, heads, 1)
        return x.view(S, B * block_size, heads, dim)

    def int8_decode_attention(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                              v_scale: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        H, D = q.shape[1], q.shape[3]
        keys = dequantize(k_data, k_scale, block_tables, H, D)
        return attend(q, keys, dequantize(v_data, v_scale, block_tables, H, D), mask)

    return CompiledFunction(int8_decode_attention)
