"""Batch-invariant attention calls: each query tile is the positions of one KV block of one request, and reads
exactly the keys those positions reach (kvserve/batch_invariant.py says why).

A tile at block b of a full-attention group reads blocks 0..b; of a sliding group, the blocks from the one holding
the window of the tile's first position up to b (the KV manager keeps them for the whole tile). So a position's
keys, mask and call shape are functions of the position alone: the same whether it is decoded, prefilled in a
chunk of any size, recomputed after a preemption or computed after a prefix hit. Tiles with the same number of
key blocks share one call, with no padding: different key counts never meet in one call."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kvserve.kv.kv_cache_manager import BlockTable
from kvserve.model.attention import TileCall


@dataclass
class TileChunk:
    """What the tiles need of one request's chunk in one layer group."""

    offset: int  # flat index of the chunk's first token
    start: int  # position of its first token
    end: int  # position after its last token
    table: BlockTable  # the request's kept blocks in this group


def tile_calls(chunks: list[TileChunk], block_size: int, window: int | None, exact_own_block: bool,
               device: str | torch.device) -> list[TileCall]:
    """The attention calls of one layer group: one per number of key blocks, each over every tile that has it."""
    by_num_blocks: dict[int, list[tuple[TileChunk, int, int]]] = defaultdict(list)
    for chunk in chunks:
        for block in range(chunk.start // block_size, (chunk.end - 1) // block_size + 1):
            first = 0 if window is None else max(0, block * block_size - window + 1) // block_size
            by_num_blocks[block - first + 1].append((chunk, block, first))
    return [_call(tiles, block_size, window, exact_own_block, device) for _, tiles in sorted(by_num_blocks.items())]


def _call(tiles: list[tuple[TileChunk, int, int]], block_size: int, window: int | None, exact_own_block: bool,
          device: str | torch.device) -> TileCall:
    bs = block_size
    column = lambda values: torch.tensor(values)[:, None]  # noqa: E731
    offsets = torch.arange(bs)
    position = column([block for _, block, _ in tiles]) * bs + offsets  # [S, bs]
    start, end = column([c.start for c, _, _ in tiles]), column([c.end for c, _, _ in tiles])
    valid = (position >= start) & (position < end)
    query_index = torch.where(valid, column([c.offset for c, _, _ in tiles]) + position - start, 0)
    table = torch.tensor([_physical(c.table, first, block) for c, block, first in tiles])  # [S, B]
    key_position = column([first for _, _, first in tiles]) * bs + torch.arange(table.shape[1] * bs)  # [S, K]
    kp, qp = key_position[:, None, :], position[:, :, None]
    visible = (kp <= qp) & valid[:, :, None]
    if window is not None:
        visible &= kp > qp - window
    visible[:, :, 0] |= ~valid  # a position that is not this step's sees one key, so no softmax row is empty
    out_rows = valid.reshape(-1).nonzero().squeeze(1)
    return TileCall(query_index.to(device), table.to(device), table[:, -1].to(device), visible.unsqueeze(1).to(device),
                    out_rows.to(device), query_index.reshape(-1)[out_rows].to(device),
                    (position < start).to(device) if exact_own_block else None)


def _physical(table: BlockTable, first: int, last: int) -> list[int]:
    """Block ids of logical blocks first..last, which the table holds in order."""
    i = table.index(first)
    return [b.block_id for b in table.blocks[i : i + last - first + 1]]
