"""INT4 KV cache in the manner of KIVI: keys quantized per channel, values per token, both asymmetric (float16
scale and zero point), two 4-bit codes per byte: a block's token t and token t + block_size/2, same channel.

Per-channel key statistics need a group of tokens; here the group is the block. A block is quantized when it
fills, and until then its tokens stay in full precision in a small staging area (the "residual": at most
block_size - 1 tokens per sequence, one staging row per partly filled block). To keep outputs independent of how
a sequence was batched, chunked, preempted or served from the prefix cache, every query reads earlier blocks in
their quantized form and its own block in full precision — exactly what decode sees, token by token — so the
runner adds the own block's exact keys to attention (`exact_own_block`)."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.kv.formats.compiled import CompiledFunction, attend, decode_kind, warm_up_decode
from kvserve.kv.kv_cache import PagedKVCache

logger = logging.getLogger("kvserve")
SCALE_DTYPE = torch.float16
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny
INT4_MAX = 15


@dataclass
class _StepPlan:
    """Where this step's new tokens go, computed once and used by every layer."""

    stage_tokens: torch.Tensor  # [n] new tokens whose block is still partial after the step ...
    stage_rows: torch.Tensor  # ... their staging rows
    stage_offsets: torch.Tensor  # ... and offsets in the block
    fill_blocks: torch.Tensor  # [F] blocks that become full this step (quantized in write)
    fill_tokens: torch.Tensor  # [m] new tokens of those blocks ...
    fill_positions: torch.Tensor  # ... and their place in a [F * block_size] scratch
    residual_positions: torch.Tensor  # [r] scratch places of earlier tokens of those blocks ...
    residual_rows: torch.Tensor  # ... read from these staging rows
    residual_offsets: torch.Tensor  # ... at these offsets


class Int4KVCache(PagedKVCache):
    format_name = "int4"
    exact = False
    exact_own_block = True

    def __init__(self, *args, max_num_seqs: int = 1, compile: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
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
        self.staging_k = torch.zeros(L, 0, bs, H, D, dtype=self.dtype, device=self.device)  # [layers, rows, ...]
        self.staging_v = torch.zeros(L, 0, bs, H, D, dtype=self.dtype, device=self.device)
        self._free_rows: list[int] = []
        # A sequence holds one staging row for its filling block, and a second during a step in which a prefill
        # chunk completes that block and starts the next (the completed block's row is read by every layer's
        # write, so it is released at the next step): 2 rows per sequence cover the worst case without growing.
        self._grow_staging(2 * max(1, max_num_seqs))
        self.row_of_block = torch.full((N,), -1, dtype=torch.long)  # staging row of each partly filled block
        self._filled_last_step: list[int] = []
        self._plans: list[_StepPlan] = []
        self._own_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's groups: own blocks, rows

    def describe(self) -> str:
        return (f"int4, keys per channel per block, values per token; {self.block_size - 1}-token full-precision "
                f"residual per sequence; {decode_kind(self.fused_decode)} decode attention")

    def warm_up(self, num_query_heads: int) -> None:
        if self.fused_decode is not None:
            warm_up_decode(self, self.fused_decode, num_query_heads, extra_keys=self.block_size + 1)
            self._own_rows = {}

    def max_draft_tokens(self, position: int) -> int:
        """A draft token in a block's last slot would quantize the block with a token that may be rejected (a
        filled block is never written again): drafts stop one slot short of the block's end."""
        offset = position % self.block_size
        return self.block_size - 1 if offset == self.block_size - 1 else self.block_size - 2 - offset

    @property
    def staging_rows(self) -> int:
        return self.staging_k.shape[1]

    @property
    def extra_nbytes(self) -> int:
        return self.staging_k.nbytes + self.staging_v.nbytes

    # ---- per step ------------------------------------------------------------------------------------------
    def begin_step(self, freed_blocks: list[int], copies: list[tuple[int, int]],
                   slot_mappings: Sequence[torch.Tensor]) -> None:
        # A copy-on-write source freed in this step (its other holders preempted) keeps its staging row until the
        # copy has read it; every other block freed or completed gives its row back first.
        stale, sources = freed_blocks + self._filled_last_step, {src for src, _ in copies}
        self._release([block for block in stale if block not in sources])
        super().begin_step(freed_blocks, copies, slot_mappings)
        self._release([block for block in stale if block in sources])
        self._plans = [self._plan(slot_mapping.cpu().long()) for slot_mapping in slot_mappings]
        self._filled_last_step = [b for plan in self._plans for b in plan.fill_blocks.tolist()]
        self._own_rows = {}

    def _plan(self, slots: torch.Tensor) -> _StepPlan:
        """Which new tokens are staged and which complete a block (then quantized with the staged ones before)."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        filling = torch.unique(blocks[offsets == self.block_size - 1])
        fills = torch.isin(blocks, filling)
        staged = (~fills).nonzero().squeeze(1)
        for block in torch.unique(blocks[staged]).tolist():
            self._row(block)
        fill_index = torch.searchsorted(filling, blocks[fills])
        first_new = torch.full((len(filling),), self.block_size, dtype=torch.long)
        first_new.scatter_reduce_(0, fill_index, offsets[fills], reduce="amin")
        earlier = torch.arange(self.block_size)[None, :] < first_new[:, None]  # [F, bs] read from staging
        fill_of_earlier, offset_of_earlier = earlier.nonzero(as_tuple=True)
        plan = _StepPlan(
            stage_tokens=staged.to(self.device),
            stage_rows=self.row_of_block[blocks[staged]].to(self.device),
            stage_offsets=offsets[staged].to(self.device),
            fill_blocks=filling.to(self.device),
            fill_tokens=fills.nonzero().squeeze(1).to(self.device),
            fill_positions=(fill_index * self.block_size + offsets[fills]).to(self.device),
            residual_positions=(fill_of_earlier * self.block_size + offset_of_earlier).to(self.device),
            residual_rows=self.row_of_block[filling[fill_of_earlier]].to(self.device),
            residual_offsets=offset_of_earlier.to(self.device),
        )
        if bool((plan.residual_rows < 0).any()):
            raise RuntimeError("int4 KV cache: a block is completed without the staged tokens before it")
        return plan

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        for src, dst in pairs:
            src_row = int(self.row_of_block[src])
            if src_row >= 0:
                dst_row = self._row(dst)
                self.staging_k[:, dst_row] = self.staging_k[:, src_row]
                self.staging_v[:, dst_row] = self.staging_v[:, src_row]

    # ---- per layer -----------------------------------------------------------------------------------------
    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        plan = self._plans[group]
        for staging, x in ((self.staging_k, k), (self.staging_v, v)):
            staging[row, plan.stage_rows, plan.stage_offsets] = x[plan.stage_tokens].to(self.dtype)
        if not len(plan.fill_blocks):
            return
        shape = (len(plan.fill_blocks), self.block_size, self.num_kv_heads, self.head_dim)
        block_k = self._assemble(plan, row, k, self.staging_k, shape)
        block_v = self._assemble(plan, row, v, self.staging_v, shape)
        fill = plan.fill_blocks
        codes, scale, zero = quantize(block_k, dim=1)  # keys: per channel over the block's tokens
        self._blocks_view(self.k, row)[fill] = pack(codes)
        self.k_scale[row, fill], self.k_zero[row, fill] = scale.squeeze(1), zero.squeeze(1)
        codes, scale, zero = quantize(block_v, dim=-1)  # values: per token over the head's channels
        self._blocks_view(self.v, row)[fill] = pack(codes)
        self._blocks_view(self.v_scale, row)[fill] = scale.squeeze(-1)
        self._blocks_view(self.v_zero, row)[fill] = zero.squeeze(-1)

    def _gather(self, row: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized blocks; a partly filled block reads as stale values (attention masks it: see gather_residual)."""
        S, B = block_tables.shape
        shape = (S, B * self.block_size, self.num_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._dequantize_into(row, block_tables, k, v)
        return k, v

    def gather_with_own_block(self, layer: int, block_tables: torch.Tensor, own_blocks: torch.Tensor,
                              new_k: torch.Tensor, new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [S, B * block_size + block_size + Q, heads, dim]: the dequantized blocks, each request's
        own block's staged tokens (gather_residual), then the chunk's new ones ([S, Q, heads, dim]), written into
        one tensor each rather than concatenated (which would copy the whole context a second time)."""
        row = self.layout.row_of[layer]
        S, B = block_tables.shape
        context, bs = B * self.block_size, self.block_size
        shape = (S, context + bs + new_k.shape[1], self.num_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._dequantize_into(row, block_tables, k[:, :context], v[:, :context])
        k[:, context:context + bs], v[:, context:context + bs] = self.gather_residual(layer, own_blocks)
        k[:, context + bs:], v[:, context + bs:] = new_k, new_v
        return k, v

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

    def gather_residual(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision K/V [S, block_size, heads, dim] staged for each of `blocks` (-1 or unstaged: zeros to mask)."""
        return self._staged(self.layout.row_of[layer], blocks)

    def _staged(self, row: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if id(blocks) not in self._own_rows:  # every layer of a step asks again for the same blocks
            rows = self.row_of_block[blocks.cpu().clamp(min=0)].to(self.device)
            self._own_rows[id(blocks)] = blocks, torch.where((blocks >= 0) & (rows >= 0), rows, 0)
        rows = self._own_rows[id(blocks)][1]
        return self.staging_k[row].index_select(0, rows), self.staging_v[row].index_select(0, rows)

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

    # ---- internals -----------------------------------------------------------------------------------------
    def _assemble(self, plan: _StepPlan, row: int, new: torch.Tensor, staging: torch.Tensor,
                  shape: tuple[int, ...]) -> torch.Tensor:
        """The full blocks of this step: earlier tokens from staging, new ones from `new`."""
        scratch = torch.empty(shape[0] * shape[1], *shape[2:], dtype=self.dtype, device=self.device)
        scratch[plan.fill_positions] = new[plan.fill_tokens].to(self.dtype)
        scratch[plan.residual_positions] = staging[row, plan.residual_rows, plan.residual_offsets]
        return scratch.view(shape)

    def _row(self, block: int) -> int:
        row = int(self.row_of_block[block])
        if row < 0:
            if not self._free_rows:
                self._grow_staging(2 * self.staging_rows)
            row = self._free_rows.pop()
            self.row_of_block[block] = row
        return row

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            row = int(self.row_of_block[block])
            if row >= 0:
                self._free_rows.append(row)
                self.row_of_block[block] = -1

    def _grow_staging(self, rows: int) -> None:
        old = self.staging_rows
        if old:
            logger.warning(f"int4 KV cache: more partly filled blocks than expected; staging grows to {rows} rows")
        shape = list(self.staging_k.shape)
        shape[1] = rows - old
        zeros = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.staging_k = torch.cat([self.staging_k, zeros], dim=1)
        self.staging_v = torch.cat([self.staging_v, zeros], dim=1)
        self._free_rows += range(rows - 1, old - 1, -1)

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
    of them. Each cache gets its own (a failure to compile is that engine's); the graphs are kept with the
    function's code, which every copy shares, so a later cache of the same shapes compiles nothing."""
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
