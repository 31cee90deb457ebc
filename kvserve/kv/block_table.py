"""What the KV cache manager and its layer groups' managers share: the sequence they serve, its block table in one
group, the cached blocks a prefix hit brings, and the block copies copy-on-write asks for."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.kv.block_pool import Block


class CachedSequence(Protocol):
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class BlockCopy:
    """Copy one physical block's K/V into another before the step's forward (copy-on-write)."""

    src: int
    dst: int


@dataclass
class BlockTable:
    """A sequence's kept blocks in one layer group, in order, and which block of the sequence each one is (block
    number i holds tokens i * block_size onwards). Without dropping the numbers are 0, 1, 2, ...; a sliding window
    or an eviction policy leaves gaps."""

    blocks: list[Block] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)

    @property
    def next_logical(self) -> int:
        return self.logical[-1] + 1 if self.logical else 0

    def extend(self, blocks: Sequence[Block], first_logical: int | None = None) -> None:
        first = self.next_logical if first_logical is None else first_logical
        self.blocks.extend(blocks)
        self.logical.extend(range(first, first + len(blocks)))

    def index(self, logical_block: int) -> int:
        """Where block number `logical_block` sits in the table (it is one of the newest: search from the end)."""
        for i in range(len(self.logical) - 1, -1, -1):
            if self.logical[i] == logical_block:
                return i
        raise KeyError(f"block {logical_block} is not held")

    def drop(self, indices: list[int]) -> list[Block]:
        """Remove the entries at `indices`; returns their blocks."""
        gone = set(indices)
        dropped = [self.blocks[i] for i in indices]
        self.blocks = [b for i, b in enumerate(self.blocks) if i not in gone]
        self.logical = [n for i, n in enumerate(self.logical) if i not in gone]
        return dropped

    def copy(self) -> BlockTable:
        return BlockTable(list(self.blocks), list(self.logical))


@dataclass
class CachedPrefix:
    """A prefix hit: its first `num_blocks` blocks are cached; for each layer group, the cached blocks it needs
    (a sliding group needs only those in the window of the first token to compute), starting at `first_logical`."""

    num_blocks: int = 0
    blocks: list[list[Block]] = field(default_factory=list)
    first_logical: list[int] = field(default_factory=list)
    state_checkpoint: int | None = None  # hybrid models: the state slot saved at the hit's end (state_cache.py)
    held_blocks: int = 0  # hybrid models: the blocks the pool held before the hit was cut back to a checkpoint

    @property
    def all_blocks(self) -> list[Block]:
        return [b for group in self.blocks for b in group]
