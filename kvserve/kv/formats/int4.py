"""INT4 KV cache in the manner of KIVI: keys quantized per channel, values per token, both asymmetric (float16
scale and zero point), two 4-bit codes per byte: a block's token t and token t + block_size/2, same channel.

Per-channel key statistics need a group of tokens; here the group is the block: a block is quantized when it
fills, and until then its tokens stay in full precision (formats.staged, which also explains why each query reads
its own block in full precision)."""
from __future__ import annotations

import torch

from kvserve.kv.formats.compiled import CompiledFunction, attend, decode_kind
from kvserve.kv.formats.staged import StagedBlockKVCache

SCALE_DTYPE = torch.float16
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny
INT4_MAX = 15


class Int4KVCache(StagedBlockKVCache):
    format_name = "int4"

    def __init__(self, *args, max_num_seqs: int = 1, compile: bool = True, **kwargs):
        super().__init__(*args, max_num_seqs=max_num_seqs, **kwargs)
        self.attend_decodes_with(fused_decode_attention(self.block_size) if compile else None)
        if self.block_size % 2:
            raise ValueError(f"int4 KV cache packs two tokens of a block per byte; block_size {self.block_size} is odd")
        L, N, bs, H, D = self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        self.k = torch.zeros(L, N * bs // 2, H, D, dtype=torch.uint8, device=self.device)  # see pack
        self.v = torch.zeros(L, N * bs // 2, H, D, dtype=torch.uint8, device=self.device)
        self.k_scale = torch.zeros(L, N, H, D, dtype=SCALE_DTYPE, device=self.device)  # per block and channel
        self.k_zero = torch.zeros(L, N, H, D, dtype=SCALE_DTYPE, device=self.device)
        self.v_scale = torch.zeros(L, N * bs, H, dtype=SCALE_DTYPE, device=self.device)  # per token
        self.v_zero = torch.zeros(L, N * bs, H, dtype=SCALE_DTYPE, device=self.device)

    def describe(self) -> str:
        return (f"int4, keys per channel per block, values per token; {self.block_size - 1}-token full-precision "
                f"residual per sequence; {decode_kind(self.fused_decode)} decode attention")

    def _store_blocks(self, row: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        codes, scale, zero = quantize(k, dim=1)  # keys: per channel over the block's tokens
        self._blocks_view(self.k, row)[blocks] = pack(codes)
        self.k_scale[row, blocks], self.k_zero[row, blocks] = scale.squeeze(1), zero.squeeze(1)
        codes, scale, zero = quantize(v, dim=-1)  # values: per token over the head's channels
        self._blocks_view(self.v, row)[blocks] = pack(codes)
        self._blocks_view(self.v_scale, row)[blocks] = scale.squeeze(-1)
        self._blocks_view(self.v_zero, row)[blocks] = zero.squeeze(-1)

    def _decode_attention(self, row: int, queries: torch.Tensor, block_tables: torch.Tensor,
                          own_blocks: torch.Tensor | None, new_k: torch.Tensor, new_v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
        N = self.num_blocks
        staged_k, staged_v = self._staged(row, own_blocks)
        args = (queries, self.k[row].view(N, -1), self.k_scale[row].view(N, -1), self.k_zero[row].view(N, -1),
                self.v[row].view(N, -1), self.v_scale[row].view(N, -1), self.v_zero[row].view(N, -1),
                block_tables, staged_k, staged_v, new_k, new_v, mask)
        dynamic = ([(t, 0) for t in args] + [(block_tables, 1), (mask, 3)]
                   if self.fused_decode.warming else ())  # requests, blocks (in the pool, per request), keys
        return self.fused_decode(args, dynamic)

    def _dequantize_into(self, row: int, block_tables: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """codes * scale + zero of the [S, B] blocks into k_out and v_out ([S, B * block_size, heads, dim], views of
        larger tensors allowed): the codes are widened straight into them, then scaled and shifted in place."""
        S, B = block_tables.shape
        H, D = self.num_kv_heads, self.head_dim
        flat = block_tables.reshape(-1)
        blocks = (S, B, self.block_size, H, D)
        k = k_out.unflatten(1, (B, self.block_size))
        unpack_into(k, self._select_blocks(self.k, row, flat).view(S, B, -1, H, D))
        per_channel = (S, B, 1, H, D)  # keys: per block and channel
        torch.addcmul(self._select_blocks(self.k_zero, row, flat).to(self.dtype).view(per_channel), k,
                      self._select_blocks(self.k_scale, row, flat).to(self.dtype).view(per_channel), out=k)
        v = v_out.unflatten(1, (B, self.block_size))
        unpack_into(v, self._select_blocks(self.v, row, flat).view(S, B, -1, H, D))
        per_token = (*blocks[:-1], 1)  # values: per token (with this broadcast addcmul is slower than two passes)
        v.mul_(self._select_blocks(self.v_scale, row, flat).to(self.dtype).view(per_token))
        v.add_(self._select_blocks(self.v_zero, row, flat).to(self.dtype).view(per_token))

    def _block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scale, self.k_zero, self.v_scale, self.v_zero]


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of x over `dim`, with float16 scale and zero point (kept dims)."""
    low = x.amin(dim=dim, keepdim=True).float()
    high = x.amax(dim=dim, keepdim=True).float()
    scale = ((high - low) / INT4_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
    zero = low.to(SCALE_DTYPE)
    codes = ((x.float() - zero.float()) / scale.float()).round_().clamp_(0, INT4_MAX).to(torch.uint8)
    return codes, scale, zero


def fused_decode_attention(block_size: int) -> CompiledFunction:
    """Decode attention over the stored codes (see formats.compiled): selecting, unpacking and scaling the codes,
    appending the staged and new tokens, and attending become a few generated loops, the block size a constant
    of them. Each cache gets its own (a failure to compile is that engine's); the graphs are saved whole, named by
    the block size, so a later cache of the same shapes, in this process or a later one, compiles nothing."""
    def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, block_tables: torch.Tensor,
                   per_channel: bool, heads: int, dim: int) -> torch.Tensor:
        """[S, B * block_size, heads, dim]: the blocks of `block_tables` [S, B], dequantized."""
        S, B = block_tables.shape
        n, bs, blocks = S * B, block_size, block_tables.reshape(-1)  # sizes as products: no symbolic divisions
        packed = codes.index_select(0, blocks).view(n, 1, bs // 2, heads * dim)
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=codes.device).view(1, 2, 1, 1)  # see pack
        x = ((packed >> shifts) & 0x0F).float().view(n, bs, heads, dim)
        stats = (n, 1, heads, dim) if per_channel else (n, bs, heads, 1)
        x = x * scale.index_select(0, blocks).float().view(stats) + zero.index_select(0, blocks).float().view(stats)
        return x.view(S, B * bs, heads, dim)

    def int4_decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                              v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
                              block_tables: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
                              new_k: torch.Tensor, new_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [S, kv_heads, heads per kv head, head_dim], already multiplied by the softmax scale."""
        H, D = q.shape[1], q.shape[3]
        keys = torch.cat([dequantize(k_codes, k_scale, k_zero, block_tables, True, H, D),
                          staged_k.float(), new_k.float()], dim=1)  # [S, K, H, D]
        values = torch.cat([dequantize(v_codes, v_scale, v_zero, block_tables, False, H, D),
                            staged_v.float(), new_v.float()], dim=1)
        return attend(q, keys, values, mask)

    return CompiledFunction(int4_decode_attention)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., block_size, heads, dim] codes 0..15 -> [..., block_size / 2, heads, dim] bytes: token t of a block in
    the low nibble, token t + block_size/2 in the high one. Each nibble of a read then fills a contiguous half of
    the block (see unpack_into, its inverse), faster on a CPU than pairing neighbouring channels."""
    half = codes.shape[-3] // 2
    return codes[..., :half, :, :] | (codes[..., half:, :, :] << 4)


def unpack_into(out: torch.Tensor, packed: torch.Tensor) -> None:
    """The codes of `packed` [..., block_size / 2, heads, dim] widened straight into `out` [..., block_size, heads,
    dim] (any float dtype; views allowed): per half of the block, one byte-sized pass and one widening copy."""
    half = packed.shape[-3]
    out[..., :half, :, :].copy_(packed & 0x0F)
    out[..., half:, :, :].copy_(packed >> 4)
