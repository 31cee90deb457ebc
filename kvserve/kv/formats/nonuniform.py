"""Non-uniform 4- and 3-bit KV cache: each head vector Hadamard-rotated, scaled by one float16 number, and each
coordinate stored as the index of the nearest level of a fixed Lloyd-Max codebook (formats.codebook).

This is TurboQuant's MSE quantizer (a rotation, then a codebook for the coordinates a rotated vector has) with a
per-vector scale in place of the unit norm, for keys and values alike. Quantizing is a bucketize against the
midpoints between levels; dequantizing is one gather from the 8 or 16 levels times the scale. Every slot holds its
token alone (codes and scale), so writes, prefix sharing, copy-on-write, preemption and the disk tier need nothing
beyond copying the bytes; unlike int4 (KIVI) nothing is staged.

The scale: the one that maps the vector's largest coordinate onto the outermost level at 4 bits, its RMS onto 1 at 3
bits (the smaller squared error on SmolLM2's K and V, docs/quality.md), then refitted to the least-squares scale
of the chosen levels. K and V are stored rotated; nothing is rotated back on a read: queries are rotated instead
and the attention output rotated back (formats.fp8 explains why that is exact), also in the compiled decode
attention (formats.compiled), which reads the packed codes in place."""
from __future__ import annotations

import torch

from kvserve.kv.formats.codebook import check_packable, codebook, pack, packed_bytes, unpack
from kvserve.kv.formats.compiled import CompiledFunction, attend, decode_kind, warm_up_decode
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.rotation import hadamard

SCALE_DTYPE = torch.float16
MIN_SCALE, MAX_SCALE = torch.finfo(SCALE_DTYPE).tiny, torch.finfo(SCALE_DTYPE).max
# --kv-cache-dtype -> (key bits, value bits)
NONUNIFORM_FORMATS = {"nuq4": (4, 4), "nuq3": (3, 3)}


class NonUniformKVCache(PagedKVCache):
    exact = False

    def __init__(self, *args, format_name: str = "nuq4", compile: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.format_name = format_name
        self.key_bits, self.value_bits = NONUNIFORM_FORMATS[format_name]
        D = self.head_dim
        for bits in {self.key_bits, self.value_bits}:
            check_packable(D, bits)
        self.rotation = hadamard(D).to(dtype=self.dtype, device=self.device)
        self._rotation_t = self.rotation.T.contiguous()
        self.codebooks = {bits: tuple(t.to(self.device) for t in codebook(D, bits))
                          for bits in {self.key_bits, self.value_bits}}
        slots = (self.num_layers, self.num_blocks * self.block_size, self.num_kv_heads)
        self.k = torch.zeros(*slots, packed_bytes(D, self.key_bits), dtype=torch.uint8, device=self.device)
        self.v = torch.zeros(*slots, packed_bytes(D, self.value_bits), dtype=torch.uint8, device=self.device)
        self.k_scale = torch.zeros(slots, dtype=SCALE_DTYPE, device=self.device)
        self.v_scale = torch.zeros(slots, dtype=SCALE_DTYPE, device=self.device)
        self.attend_decodes_with(fused_decode_attention(self.block_size, self.key_bits, self.value_bits)
                                 if compile else None)

    def describe(self) -> str:
        bits = (f"{self.key_bits}-bit" if self.key_bits == self.value_bits
                else f"{self.key_bits}-bit keys, {self.value_bits}-bit values")
        return (f"{self.format_name}, {bits} Lloyd-Max codes of Hadamard-rotated head vectors, per-token-head scales; "
                f"{decode_kind(self.fused_decode)} decode attention")

    def warm_up(self, num_query_heads: int) -> None:
        if self.fused_decode is not None:
            warm_up_decode(self, self.fused_decode, num_query_heads, extra_keys=0)

    def quantize(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, heads, dim] -> packed codes [T, heads, packed bytes] and float16 scales [T, heads] of x rotated."""
        x = self.tiles.map(lambda t: t.to(self.dtype) @ self.rotation, x).float()
        levels, midpoints = self.codebooks[bits]
        if bits >= 4:
            scale = x.abs().amax(dim=-1) / levels[-1]
        else:
            scale = x.norm(dim=-1) / self.head_dim**0.5
        codes = torch.bucketize(x / scale.clamp(min=MIN_SCALE)[..., None], midpoints).to(torch.uint8)
        chosen = levels[codes.long()]
        fitted = (x * chosen).sum(-1) / (chosen * chosen).sum(-1).clamp(min=MIN_SCALE)  # least squares
        return pack(codes, bits), fitted.clamp(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
        """Packed codes [..., heads, bytes] and scales [..., heads] -> rotated vectors in the compute dtype."""
        codes = unpack(packed, bits, self.head_dim)
        return (self.codebooks[bits][0][codes.long()] * scale.float()[..., None]).to(self.dtype)

    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for data, scales, x, bits in ((self.k, self.k_scale, k, self.key_bits),
                                      (self.v, self.v_scale, v, self.value_bits)):
            codes, scale = self.quantize(x, bits)
            data[row].index_copy_(0, slot_mapping, codes)
            scales[row].index_copy_(0, slot_mapping, scale)

    def _gather(self, row: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = block_tables.reshape(-1)
        lead = (*block_tables.shape[:-1], block_tables.shape[-1] * self.block_size, self.num_kv_heads)
        out = []
        for data, scales, bits in ((self.k, self.k_scale, self.key_bits), (self.v, self.v_scale, self.value_bits)):
            codes = self._blocks_view(data, row).index_select(0, flat).view(*lead, -1)
            scale = self._blocks_view(scales, row).index_select(0, flat).view(lead)
            out.append(self.dequantize(codes, scale, bits))
        return out[0], out[1]

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        """Over the stored blocks alone (the new token was written, and is read back like every other), with the
        queries rotated as the keys were and the output rotated back."""
        N = self.num_blocks
        args = (queries @ self.rotation, self.k[row].view(N, -1), self.k_scale[row].view(N, -1),
                self.codebooks[self.key_bits][0], self.v[row].view(N, -1), self.v_scale[row].view(N, -1),
                self.codebooks[self.value_bits][0], block_tables, mask)
        dynamic = [(t, 0) for t in args if t.dim() > 1] + [(block_tables, 1), (mask, 3)] \
            if self.fused_decode.warming else ()
        out = self.fused_decode(args, dynamic)
        return None if out is None else out @ self._rotation_t

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.v_scale]


def fused_decode_attention(block_size: int, key_bits: int, value_bits: int) -> CompiledFunction:
    """Decode attention over the packed codes (see formats.compiled): selecting the blocks, unpacking the codes,
    looking up their levels, scaling and attending become a few generated loops; block size and bits are constants
    of them. Each cache gets its own; the graphs are kept with the function's code, shared by every copy."""
    def dequantize(packed: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor, block_tables: torch.Tensor,
                   bits: int, heads: int, dim: int) -> torch.Tensor:
        S, B = block_tables.shape
        n, blocks = S * B, block_tables.reshape(-1)  # sizes as products: no symbolic divisions
        codes = unpack(packed.index_select(0, blocks).view(n, block_size, heads, -1), bits, dim)
        x = levels[codes.long()] * scale.index_select(0, blocks).float().view(n, block_size, heads, 1)
        return x.view(S, B * block_size, heads, dim)

    def nonuniform_decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                                    k_levels: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
                                    v_levels: torch.Tensor, block_tables: torch.Tensor,
                                    mask: torch.Tensor) -> torch.Tensor:
        """q [S, kv_heads, heads per kv head, head_dim], rotated and multiplied by the softmax scale."""
        H, D = q.shape[1], q.shape[3]
        keys = dequantize(k_codes, k_scale, k_levels, block_tables, key_bits, H, D)
        return attend(q, keys, dequantize(v_codes, v_scale, v_levels, block_tables, value_bits, H, D), mask)

    return CompiledFunction(nonuniform_decode_attention)
