"""Batch-invariant attention calls: each query tile is the positions of one KV block of one request, and reads
exactly the keys those positions reach (kvserve/batch_invariant.py says why).

A tile at block b of a full-attention group reads blocks 0..b; of a sliding group, the blocks from the one holding
the window of the tile's first position up to b (the KV manager keeps them for the whole tile). So a position's
keys, mask and call shape are functions of the position alone: the same whether it is decoded, prefilled in a
chunk of any size, recomputed after a preemption or computed after a prefix hit. Tiles with the same number of
key blocks and of positions share one call, with no padding: each position is a query head of its own there
(kv/readers.py, TileReader), so a query is one [1, head_dim] x [head_dim, keys] problem however many share the call."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kvserve.kv.kv_cache_manager import BlockTable
from kvserve.kv.readers import TileCall


@dataclass
class TileChunk:
    """What the tiles need of one request's chunk in one layer group."""

    offset: int  # flat index of the chunk's first token
    start: int  # position of its first token
    end: int  # position after its last token
    table: BlockTable  # the request's kept blocks in this group


def tile_calls(chunks: list[TileChunk], block_size: int, window: int | None, exact_own_block: bool,
               device: str | torch.device) -> list[TileCall]:
    """The attention calls of one layer group: one per (key blocks, positions) shape, over every tile that has it."""
    by_shape: dict[tuple[int, int], list[tuple[TileChunk, int, int]]] = defaultdict(list)
    for chunk in chunks:
        for block in range(chunk.start // block_size, (chunk.end - 1) // block_size + 1):
            first = 0 if window is None else max(0, block * block_size - window + 1) // block_size
            positions = min(chunk.end, (block + 1) * block_size) - max(chunk.start, block * block_size)
            by_shape[block - first + 1, positions].append((chunk, block, first))
    return [_call(tiles, block_size, window, exact_own_block, device) for _, tiles in sorted(by_shape.items())]


def _call(tiles: list[tuple[TileChunk, int, int]], block_size: int, window: int | None, exact_own_block: bool,
          device: str | torch.device) -> TileCall:
    bs = block_size
    column = lambda values: torch.tensor(values)[:, None]  # noqa: E731
    start, end = column([c.start for c, _, _ in tiles]), column([c.end for c, _, _ in tiles])
    block_start = column([block for _, block, _ in tiles]) * bs
    first_position = torch.maximum(start, block_start)  # [S, 1] the tile's first position in this step
    num_positions = int(torch.minimum(end, block_start + bs)[0] - first_position[0])
    position = first_position + torch.arange(num_positions)  # [S, P]
    offset = column([c.offset for c, _, _ in tiles])
    table = torch.tensor([_physical(c.table, first, block) for c, block, first in tiles])  # [S, B]
    key_position = column([first for _, _, first in tiles]) * bs + torch.arange(table.shape[1] * bs)  # [S, K]
    kp, qp = key_position[:, None, :], position[:, :, None]
    visible = kp <= qp
    if window is not None:
        visible &= kp > qp - window
    staged = own_index = None
    if exact_own_block:
        own_position = block_start + torch.arange(bs)  # [S, bs]
        staged = own_position < start
        own_index = torch.where(~staged & (own_position < end), offset + own_position - start, 0)
    return TileCall((offset + position - start).to(device), table.to(device), table[:, -1].to(device),
                    visible.to(device), _to(staged, device), _to(own_index, device))


def _to(tensor: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    return tensor.to(device) if tensor is not None else None


def _physical(table: BlockTable, first: int, last: int) -> list[int]:
    """Block ids of logical blocks first..last, which the table holds in order."""
    i = table.index(first)
    return [b.block_id for b in table.blocks[i : i + last - first + 1]]
