"""A picture of the block pool at one moment, for the dashboard: a state per block and its place in the LRU queue.

Built from the pool's public views only (its blocks and its free queue), in a few flat lists rather than one
object per block, so thousands of blocks cost about a millisecond to take."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool

# One letter per state: the dashboard's grid colours each one. A new kind of block (a quantized format,
# evicted or out-of-window blocks) gets a letter here and a colour in the page's palette.
BLOCK_STATES = {
    "F": "free",  # unreferenced and empty: never used, or its content was dropped
    "C": "cached",  # unreferenced, still holding a full block findable by prefix lookup
    "U": "in_use",  # held by exactly one live sequence
    "S": "shared",  # held by more than one (a shared prefix, n>1 samples, beam search)
}
_LETTERS = {name: letter for letter, name in BLOCK_STATES.items()}


@dataclass(frozen=True)
class PoolSnapshot:
    """Per block `i`: states[i] (a letter of BLOCK_STATES), ref_cnts[i] and free_ranks[i] (its place in the free
    queue, 0 = reused next; -1 while referenced)."""

    states: str
    ref_cnts: list[int]
    free_ranks: list[int]

    def count(self, state: str) -> int:
        """How many blocks are in `state`, a name of BLOCK_STATES such as "cached"."""
        return self.states.count(_LETTERS[state])


def snapshot_pool(pool: BlockPool) -> PoolSnapshot:
    """The state of every block of `pool` now."""
    blocks = pool.blocks
    ref_cnts = [block.ref_cnt for block in blocks]
    states = "".join(
        ("S" if ref > 1 else "U") if ref else ("F" if block.block_hash is None else "C")
        for block, ref in zip(blocks, ref_cnts)
    )
    free_ranks = [-1] * len(blocks)
    for rank, block_id in enumerate(pool.free_block_ids()):
        free_ranks[block_id] = rank
    return PoolSnapshot(states, ref_cnts, free_ranks)
