"""Formats that quantize a block when it fills (int4, nuq4, nuq3): per-channel key statistics need a group of
tokens, and here the group is the block.

Until a block fills, its tokens stay in full precision in a small staging area (the "residual": at most
block_size - 1 tokens per sequence, one staging row per partly filled block); the step that fills it hands the whole
block to the format (`_store_blocks`). To keep outputs independent of how a sequence was batched, chunked, preempted
or served from the prefix cache, every query reads earlier blocks in their quantized form and its own block in full
precision — exactly what decode sees, token by token — so the runner adds the own block's exact keys to attention
(`exact_own_block`). A filled block's bytes are final: prefix sharing, copy-on-write of full blocks and the disk tier
copy them as they are; copy-on-write of a partly filled block copies its staging row.

A format whose compiled decode reads K and V in another basis (nuq: Hadamard-rotated) also keeps its staged tokens
in that basis (`stage_rotated`), each rotated once as it is written, so a decode step rotates only its new tokens
rather than its whole block; the exact copy stays what the gathers return."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.kv.formats.compiled import warm_up_decode
from kvserve.kv.kv_cache import PagedKVCache

logger = logging.getLogger("kvserve")


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


class StagedBlockKVCache(PagedKVCache):
    """Full-precision staging of partly filled blocks. A subclass stores a filled block (`_store_blocks`) and reads
    blocks back (`_dequantize_into`); `max_num_seqs` sizes the staging (it grows, with a warning, if exceeded)."""

    exact = False
    exact_own_block = True

    def __init__(self, *args, max_num_seqs: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        L, bs, H, D = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        self.staging_k = torch.zeros(L, 0, bs, H, D, dtype=self.dtype, device=self.device)  # [layers, rows, ...]
        self.staging_v = torch.zeros(L, 0, bs, H, D, dtype=self.dtype, device=self.device)
        self.rotated_k: torch.Tensor | None = None  # the staged tokens in `staging_basis` (stage_rotated)
        self.rotated_v: torch.Tensor | None = None
        self.staging_basis: torch.Tensor | None = None
        self._free_rows: list[int] = []
        # A sequence holds one staging row for its filling block, and a second during a step in which a prefill
        # chunk completes that block and starts the next (the completed block's row is read by every layer's
        # write, so it is released at the next step): 2 rows per sequence cover the worst case without growing.
        self._grow_staging(2 * max(1, max_num_seqs))
        self.row_of_block = torch.full((self.num_blocks,), -1, dtype=torch.long)  # staging row of a partial block
        self._filled_last_step: list[int] = []
        self._plans: list[_StepPlan] = []
        self._own_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's groups: own blocks, rows

    def warm_up(self, num_query_heads: int) -> None:
        if self.fused_decode is not None:
            warm_up_decode(self, self.fused_decode, num_query_heads, extra_keys=self.block_size + 1)
            self._own_rows = {}

    def max_draft_tokens(self, position: int) -> int:
        """A draft token in a block's last slot would quantize the block with a token that may be rejected (a
        filled block is never written again): drafts stop one slot short of the block's end."""
        offset = position % self.block_size
        return self.block_size - 1 if offset == self.block_size - 1 else self.block_size - 2 - offset

    def stage_rotated(self, basis: torch.Tensor | None) -> None:
        """Keep the staged tokens also multiplied by `basis` [head_dim, head_dim] (`_staged(..., rotated=True)`); None:
        no longer (nothing will read them)."""
        self.staging_basis = basis
        if basis is None:
            self.rotated_k = self.rotated_v = None
        else:
            self.rotated_k, self.rotated_v = torch.zeros_like(self.staging_k), torch.zeros_like(self.staging_v)

    @property
    def staging_rows(self) -> int:
        return self.staging_k.shape[1]

    @property
    def extra_nbytes(self) -> int:
        return sum(t.nbytes for t in self._stagings())

    # ---- what a format adds ---------------------------------------------------------------------------------
    def _store_blocks(self, row: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store the full blocks `blocks` ([F] ids) of storage row `row` from their K and V
        ([F, block_size, heads, dim], the compute dtype)."""
        raise NotImplementedError

    def _dequantize_into(self, row: int, block_tables: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """The [S, B] blocks read back into k_out and v_out ([S, B * block_size, heads, dim], views allowed); a
        partly filled block reads as stale values (attention masks it: see gather_residual)."""
        raise NotImplementedError

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

    def rewind_step(self) -> None:
        # the blocks the last step filled keep their staging rows: running it again fills them again from them
        self._filled_last_step = []

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
            raise RuntimeError(f"{self.format_name} KV cache: a block is completed without the staged tokens before it")
        return plan

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        for src, dst in pairs:
            src_row = int(self.row_of_block[src])
            if src_row >= 0:
                dst_row = self._row(dst)
                for staging in self._stagings():
                    staging[:, dst_row] = staging[:, src_row]

    # ---- per layer -----------------------------------------------------------------------------------------
    def _write(self, row: int, group: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        plan = self._plans[group]
        for staging, rotated, x in ((self.staging_k, self.rotated_k, k), (self.staging_v, self.rotated_v, v)):
            staged = x[plan.stage_tokens].to(self.dtype)
            staging[row, plan.stage_rows, plan.stage_offsets] = staged
            if rotated is not None:
                rotated[row, plan.stage_rows, plan.stage_offsets] = staged @ self.staging_basis
        if not len(plan.fill_blocks):
            return
        shape = (len(plan.fill_blocks), self.block_size, self.num_kv_heads, self.head_dim)
        block_k = self._assemble(plan, row, k, self.staging_k, shape)
        block_v = self._assemble(plan, row, v, self.staging_v, shape)
        self._store_blocks(row, plan.fill_blocks, block_k, block_v)

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

    def gather_residual(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision K/V [S, block_size, heads, dim] staged for each of `blocks` (-1 or unstaged: zeros to mask)."""
        return self._staged(self.layout.row_of[layer], blocks)

    def _staged(self, row: int, blocks: torch.Tensor, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged K and V of `blocks` (as gather_residual); `rotated`: in `staging_basis` (stage_rotated)."""
        if id(blocks) not in self._own_rows:  # every layer of a step asks again for the same blocks
            rows = self.row_of_block[blocks.cpu().clamp(min=0)].to(self.device)
            self._own_rows[id(blocks)] = blocks, torch.where((blocks >= 0) & (rows >= 0), rows, 0)
        rows = self._own_rows[id(blocks)][1]
        k, v = (self.rotated_k, self.rotated_v) if rotated else (self.staging_k, self.staging_v)
        return k[row].index_select(0, rows), v[row].index_select(0, rows)

    # ---- internals -----------------------------------------------------------------------------------------
    def _assemble(self, plan: _StepPlan, row: int, new: torch.Tensor, staging: torch.Tensor,
                  shape: tuple[int, ...]) -> torch.Tensor:
        """The full blocks of this step: earlier tokens from staging, new ones from `new`."""
        scratch = torch.empty(shape[0] * shape[1], *shape[2:], dtype=self.dtype, device=self.device)
        scratch[plan.fill_positions] = new[plan.fill_tokens].to(self.dtype)
        scratch[plan.residual_positions] = staging[row, plan.residual_rows, plan.residual_offsets]
        return scratch.view(shape)

    def _stagings(self) -> list[torch.Tensor]:
        return [t for t in (self.staging_k, self.staging_v, self.rotated_k, self.rotated_v) if t is not None]

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
            logger.warning(f"{self.format_name} KV cache: more partly filled blocks than expected; staging grows to "
                           f"{rows} rows")
        shape = list(self.staging_k.shape)
        shape[1] = rows - old
        zeros = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for name in ("staging_k", "staging_v", "rotated_k", "rotated_v"):
            if getattr(self, name) is not None:
                setattr(self, name, torch.cat([getattr(self, name), zeros], dim=1))
        self._free_rows += range(rows - 1, old - 1, -1)
