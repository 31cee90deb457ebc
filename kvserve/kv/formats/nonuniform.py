"""Non-uniform 4- and 3-bit KV cache (nuq4, nuq3, and nuq3k4v: 3-bit keys, 4-bit values): keys per channel over each
block, values per token with a fixed Lloyd-Max codebook; K and V Hadamard-rotated.

Keys carry large offsets in a few channels, the same for neighbouring tokens (docs/quality.md). A scale per head
vector spends its levels on them; statistics per channel over a block remove them first (KIVI's and KVQuant's
keys). So each key channel of a full block is stored as its midpoint (float16), its half range (float16 for nuq4;
for the others one byte, its base-2 logarithm in sixteenths, so that nuq3 holds 1.3x int4's tokens) and a code per
token on an evenly spaced grid from -1 to 1; the midpoint is then refitted to the chosen codes (least squares). The grid
keeps each channel's extreme tokens, the ones attention singles out, on its end levels: a Lloyd-Max codebook fitted
to the block's normalized values measured no better, and one scaled by the channel's RMS clipped those tokens
(docs/quality.md). Values are rotated head vectors on the Lloyd-Max codebook of formats.codebook, scaled by one
float16 number per token and head (TurboQuant's MSE quantizer with a scale in place of the unit norm), read back
by a polynomial through the levels (formats.codebook.levels_of).

The filling block stays in full precision until it fills (formats.staged, shared with int4), and each query reads
its own block from there. Stored K and V are in the rotated basis; a gather rotates them back, since the staged
and new tokens it joins are not rotated. The compiled decode attention (formats.compiled) reads the codes in place
and rotates the query and the new token instead, reads the staged tokens from a rotated copy kept beside the exact
one (formats.staged, stage_rotated), and rotates its output back (formats.fp8 explains why that is exact). Storing a
block finds each key's level by rounding (the grid is even) and each value's by a table
(formats.codebook.NearestLevel), not by a search, in one compiled kernel of its own where decode is compiled."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.graph_buffers import in_buffer
from kvserve.kv.formats.codebook import (NearestLevel, check_packable, codebook, levels_of, pack, packed_rows,
                                         unpack)
from kvserve.kv.formats.compiled import CompiledFunction, attend, decode_kind
from kvserve.kv.formats.staged import StagedBlockKVCache
from kvserve.rotation import hadamard

SCALE_DTYPE = torch.float16
MIN_SCALE, MAX_SCALE = torch.finfo(SCALE_DTYPE).tiny, torch.finfo(SCALE_DTYPE).max
LOG_STEPS = 16  # an int8 half range is 2 ** (code / LOG_STEPS): 2^-8 to 2^7.94 in steps of 4.4%


@dataclass(frozen=True)
class NonUniformBits:
    """Bits of a key and a value code, and how a key channel's half range is stored (float16, or int8: its log)."""

    key_bits: int
    value_bits: int
    key_scale_dtype: torch.dtype


NONUNIFORM_FORMATS = {"nuq4": NonUniformBits(4, 4, torch.float16), "nuq3": NonUniformBits(3, 3, torch.int8),
                      "nuq3k4v": NonUniformBits(3, 4, torch.int8)}


class NonUniformKVCache(StagedBlockKVCache):
    def __init__(self, *args, format_name: str = "nuq4", max_num_seqs: int = 1, compile: bool = True, **kwargs):
        self.format_name = format_name
        super().__init__(*args, max_num_seqs=max_num_seqs, **kwargs)
        bits = NONUNIFORM_FORMATS[format_name]
        self.key_bits, self.value_bits, self.key_scale_dtype = bits.key_bits, bits.value_bits, bits.key_scale_dtype
        L, N, bs, H, D = self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        for b in {self.key_bits, self.value_bits}:
            check_packable(bs, b, format_name)
        self.basis = hadamard(D).to(dtype=self.dtype, device=self.device)  # K and V are stored multiplied by it
        self._basis_t = self.basis.T.contiguous()
        self.value_levels, midpoints, self.value_coefficients = codebook(D, self.value_bits)
        self.value_levels = self.value_levels.to(self.device)
        self._nearest_value_level = NearestLevel(midpoints.to(self.device))
        # codes packed across each block's tokens (formats.codebook): packed_rows(bs, bits) rows of [H, D] bytes
        self.k = torch.zeros(L, N * packed_rows(bs, self.key_bits), H, D, dtype=torch.uint8, device=self.device)
        self.k_offset = torch.zeros(L, N, H, D, dtype=SCALE_DTYPE, device=self.device)  # per block and channel
        self.k_scale = torch.zeros(L, N, H, D, dtype=self.key_scale_dtype, device=self.device)
        self.v = torch.zeros(L, N * packed_rows(bs, self.value_bits), H, D, dtype=torch.uint8, device=self.device)
        self.v_scale = torch.zeros(L, N * bs, H, dtype=SCALE_DTYPE, device=self.device)  # per token
        self.attend_decodes_with(fused_decode_attention(self.block_size, self.key_bits, self.value_bits,
                                                        self.value_coefficients)
                                 if compile else None)
        self._quantize = quantizer(bits, self._nearest_value_level)
        self.compiled_store = CompiledFunction(self._quantize) if compile else None
        if compile:
            self.stage_rotated(self.basis)

    def warm_up(self, num_query_heads: int) -> None:
        super().warm_up(num_query_heads)
        if self.rotated_k is not None and (self.fused_decode is None or self.fused_decode.failed is not None):
            self.stage_rotated(None)  # only the compiled decode attention reads the rotated staging: it failed
        if self.compiled_store is not None:
            shape = (2, self.block_size, self.num_kv_heads, self.head_dim)
            with torch.inference_mode(), self.compiled_store.warming_up():
                self.quantize_blocks(*(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2)))

    def compiled_kernels(self) -> dict:
        stores = {} if self.compiled_store is None else {"block store": self.compiled_store}
        return {**super().compiled_kernels(), **stores}

    def describe(self) -> str:
        return (f"{self.format_name}, {self.key_bits}-bit keys per channel per block, {self.value_bits}-bit Lloyd-Max "
                f"codes of Hadamard-rotated values per token; {self.block_size - 1}-token full-precision residual per "
                f"sequence{', kept also rotated' if self.rotated_k is not None else ''}; "
                f"{decode_kind(self.fused_decode)} decode attention")

    # ---- quantizing -------------------------------------------------------------------------------------------
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, dim] -> the same vectors in the stored basis, float32, token by token (tiles.map)."""
        return self.tiles.map(lambda t: t.to(self.dtype) @ self.basis, x).float()

    def quantize_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full blocks [F, block_size, heads, dim] -> codes packed across each block's tokens [F, rows, heads, dim]
        (formats.codebook), float16 midpoints and stored half ranges [F, heads, dim] of each rotated channel over
        the block (quantize_keys)."""
        return quantize_keys(self.rotate(k.flatten(0, 1)).view(k.shape), self.key_bits, self.key_scale_dtype)

    def quantize_values(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full blocks [F, block_size, heads, dim] -> codes packed across each block's tokens [F, rows, heads, dim]
        and float16 scales [F, block_size, heads] (quantize_values)."""
        return quantize_values(self.rotate(v.flatten(0, 1)).view(v.shape), self.value_levels,
                               self._nearest_value_level, self._nearest_value_level.table, self.value_bits)

    def quantize_blocks(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Full blocks' K and V [F, block_size, heads, dim] -> quantize_keys' and quantize_values' results, rotated
        here and quantized by the compiled store kernel where there is one (one call for the ~30 operations)."""
        args = (self.rotate(k.flatten(0, 1)).view(k.shape), self.rotate(v.flatten(0, 1)).view(v.shape),
                self.value_levels, self._nearest_value_level.table)
        stored = None if self.compiled_store is None else \
            self.compiled_store(args, [(args[0], 0), (args[1], 0)] if self.compiled_store.warming else ())
        return stored or self._quantize(*args)

    def _store_blocks(self, row: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_codes, k_offset, k_scale, v_codes, v_scale = self.quantize_blocks(k, v)
        self._blocks_view(self.k, row)[blocks] = k_codes
        self.k_offset[row, blocks], self.k_scale[row, blocks] = k_offset, k_scale
        self._blocks_view(self.v, row)[blocks] = v_codes
        self._blocks_view(self.v_scale, row)[blocks] = v_scale

    # ---- reading ----------------------------------------------------------------------------------------------
    def _dequantize_into(self, row: int, block_tables: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """The [S, B] blocks dequantized and rotated back into k_out and v_out ([S, B * block_size, heads, dim])."""
        S, B = block_tables.shape
        flat, H, D = block_tables.reshape(-1), self.num_kv_heads, self.head_dim
        k_codes, k_offset, k_scale, v_codes, v_scale = (self._select_blocks(t, row, flat) for t in
                                                        (self.k, self.k_offset, self.k_scale, self.v, self.v_scale))
        rotated = dequantize_blocks(k_codes, k_offset, k_scale, v_codes, v_scale, self.value_coefficients,
                                    (self.key_bits, self.value_bits), (self.block_size, H, D))
        for out, x in zip((k_out, v_out), rotated):
            back = self.tiles.map(lambda t: t.to(self.dtype) @ self._basis_t, x.flatten(0, 1))
            out.copy_(back.view(S, B * self.block_size, H, D))

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        """Over the codes in place, with the query, the own block's staged tokens and the new ones rotated as the
        stored K and V were, and the output rotated back (all in the kernel; the staged tokens kept rotated)."""
        N = self.num_blocks
        staged_k, staged_v = self._staged(row, own_blocks, rotated=True)
        k_scale = self.k_scale[row].view(N, -1)
        args = (queries, self.k[row].view(N, -1), self.k_offset[row].view(N, -1), k_scale, self.v[row].view(N, -1),
                self.v_scale[row].view(N, -1), block_tables, staged_k, staged_v, new_k, new_v, mask, self.basis)
        dynamic = [(t, 0) for t in args[:-1] if t.dim() > 1] + [(block_tables, 1), (mask, 3)] \
            if self.fused_decode.warming else ()  # not the basis's
        return self.fused_decode(args, dynamic)

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_offset, self.k_scale, self.v_scale]


def quantize_keys(x: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rotated full blocks [F, block_size, heads, dim] (float32) -> codes packed across each block's tokens [F, rows,
    heads, dim], float16 midpoints and stored half ranges [F, heads, dim] of each channel over the block."""
    low, high = x.amin(dim=1), x.amax(dim=1)
    scale = encode_half_range((high - low) / 2, scale_dtype)
    half = decode_half_range(scale)[:, None]
    # the nearest level of the even grid -1, -1 + step, ..., 1 by rounding (a search would run value by value)
    top, step = 2**bits - 1, 2 / (2**bits - 1)
    codes = ((x - ((high + low) / 2)[:, None]) / (half * step) + top / 2).round_().clamp_(0, top)
    offset = (x - (codes * step - 1) * half).mean(dim=1)  # least squares, given the codes and half range
    return pack(codes.to(torch.uint8), bits), offset.to(SCALE_DTYPE), scale


def quantize_values(x: torch.Tensor, levels: torch.Tensor, nearest: NearestLevel, table: torch.Tensor,
                    bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated full blocks [F, block_size, heads, dim] (float32) -> codes packed across each block's tokens [F, rows,
    heads, dim] and float16 scales [F, block_size, heads] of each token's vector: the scale maps the largest
    coordinate onto the outermost level at 4 bits, the RMS onto 1 at 3 bits (the smaller error on SmolLM2's values),
    then refitted to the chosen levels (least squares). `table`: nearest's (NearestLevel)."""
    scale = x.abs().amax(dim=-1) / levels[-1] if bits >= 4 else x.norm(dim=-1) / x.shape[-1]**0.5
    codes = nearest(x / scale.clamp(min=MIN_SCALE)[..., None], table)
    chosen = levels.index_select(0, codes.view(-1).int()).view(x.shape)
    fitted = (x * chosen).sum(-1) / (chosen * chosen).sum(-1).clamp(min=MIN_SCALE)
    return pack(codes, bits), fitted.clamp(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)


def quantizer(bits: NonUniformBits, nearest: NearestLevel):
    """Rotated full blocks' keys and values, the codebook's levels and nearest's table -> what a block stores."""
    def nonuniform_quantize(k: torch.Tensor, v: torch.Tensor, levels: torch.Tensor,
                            table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*quantize_keys(k, bits.key_bits, bits.key_scale_dtype),
                *quantize_values(v, levels, nearest, table, bits.value_bits))

    return nonuniform_quantize


def encode_half_range(half: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A key channel's half range as stored: float16, or int8 round(log2(half) * LOG_STEPS) (saturating)."""
    if dtype == torch.int8:
        return (half.clamp(min=MIN_SCALE).log2() * LOG_STEPS).round().clamp(-128, 127).to(torch.int8)
    return half.clamp(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)


def decode_half_range(stored: torch.Tensor) -> torch.Tensor:
    """The inverse of encode_half_range, in float32 (never 0: codes divide by it)."""
    if stored.dtype == torch.int8:
        return torch.exp2(stored.float() / LOG_STEPS)
    return stored.float().clamp(min=MIN_SCALE)


def dequantize_blocks(k_codes: torch.Tensor, k_offset: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                      v_scale: torch.Tensor, value_coefficients: tuple[float, ...], bits: tuple[int, int],
                      shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """n selected blocks' rows (one flat row per block, as _select_blocks gives them) -> rotated K and V [n,
    block_size, heads, dim] in float32; `shape` is (block_size, heads, dim). Plain tensor ops, so the compiled decode
    attention fuses them."""
    n, (bs, heads, dim) = k_codes.shape[0], shape
    half = decode_half_range(k_scale).view(n, 1, heads, dim)
    # level i of the even grid is -1 + i * step: arithmetic, not a gather, which the compiled loops vectorize; each
    # block's and channel's factor and shift computed once (in_buffer), not for every key of the block
    step = 2 / (2 ** bits[0] - 1)
    keys = unpack(k_codes.view(n, packed_rows(bs, bits[0]), heads, dim), bits[0]).float() * in_buffer(half * step)
    keys = keys + in_buffer(k_offset.float().view(n, 1, heads, dim) - half)
    # the codebook's levels by a polynomial, not a gather (which Inductor's CPU loops load element by element)
    values = levels_of(unpack(v_codes.view(n, packed_rows(bs, bits[1]), heads, dim), bits[1]), value_coefficients,
                       bits[1])
    return keys, values * v_scale.float().view(n, bs, heads, 1)


def fused_decode_attention(block_size: int, key_bits: int, value_bits: int,
                           value_coefficients: tuple[float, ...]) -> CompiledFunction:
    """Decode attention over the packed codes (see formats.compiled): selecting the blocks, unpacking the codes,
    decoding the keys' half ranges (once per block and channel: dequantize_blocks keeps the keys' factors and
    shifts in_buffer), looking up their levels, scaling, shifting and attending become a few generated loops; block
    size, bits and the codebook's polynomial are constants of them. Each cache gets its own; the graphs are saved
    whole, named by those constants."""
    def nonuniform_decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_offset: torch.Tensor,
                                    k_scale: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
                                    block_tables: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
                                    new_k: torch.Tensor, new_v: torch.Tensor, mask: torch.Tensor,
                                    basis: torch.Tensor) -> torch.Tensor:
        """q [S, kv_heads, heads per kv head, head_dim], multiplied by the softmax scale; staged_k and staged_v [S,
        block_size, kv_heads, head_dim]: the own block's staged tokens, rotated (stage_rotated); new_k and new_v [S,
        1, kv_heads, head_dim]: the new one. The query and the new token are rotated here, as broadcast products and
        sums (small: a few loops of the kernel, not four more operations a layer), and the output rotated back."""
        S, B = block_tables.shape
        H, D, dtype = q.shape[1], q.shape[3], q.dtype
        q, new_k, new_v = ((x[..., None].float() * basis).sum(-2) for x in (q, new_k, new_v))
        blocks = block_tables.reshape(-1)
        keys, values = dequantize_blocks(k_codes.index_select(0, blocks), k_offset.index_select(0, blocks),
                                         k_scale.index_select(0, blocks),
                                         v_codes.index_select(0, blocks),
                                         v_scale.index_select(0, blocks), value_coefficients, (key_bits, value_bits),
                                         (block_size, H, D))
        keys = torch.cat([keys.view(S, B * block_size, H, D), staged_k.float(), new_k], dim=1)
        values = torch.cat([values.view(S, B * block_size, H, D), staged_v.float(), new_v], dim=1)
        return (attend(q, keys, values, mask)[..., :, None] * basis.T).sum(-2).to(dtype)

    return CompiledFunction(nonuniform_decode_attention)
