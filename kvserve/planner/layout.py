"""How a model's attention layers share one pool of KV blocks.

Layers are split into groups of equal size, each of one kind: full attention, or a sliding window. Each group has
its own block table per sequence, so a sliding group frees the blocks its window has left behind while a full
group keeps them all; one pool serves every group because all blocks are the same size (block_size tokens of the
group's `layers_per_block` layers). vLLM's hybrid KV cache manager does the same. A model whose layers are all
of one kind has one group holding every layer: a block is then block_size tokens of the whole model."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    group_of: tuple[int, ...]  # for each attention layer, its group
    row_of: tuple[int, ...]  # for each attention layer, its row within a block of that group
    windows: tuple[int | None, ...]  # for each group, its sliding window in tokens (None: full attention)

    @classmethod
    def from_layer_windows(cls, windows: Sequence[int | None]) -> KVLayout:
        """Group layers by kind (same window), in layer order, into groups of gcd(count of each kind) layers."""
        if not windows:
            raise ValueError("a KV layout needs at least one attention layer")
        counts: dict[int | None, int] = {}
        for window in windows:
            counts[window] = counts.get(window, 0) + 1
        per_group = math.gcd(*counts.values())
        group_of, row_of, group_windows = [], [], []
        open_group: dict[int | None, tuple[int, int]] = {}  # kind -> (group, rows filled)
        for window in windows:
            group, filled = open_group.get(window, (-1, per_group))
            if filled == per_group:
                group, filled = len(group_windows), 0
                group_windows.append(window)
            group_of.append(group)
            row_of.append(filled)
            open_group[window] = (group, filled + 1)
        return cls(tuple(group_of), tuple(row_of), tuple(group_windows))

    @classmethod
    def uniform(cls, num_layers: int) -> KVLayout:
        return cls.from_layer_windows([None] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_block(self) -> int:
        return len(self.group_of) // self.num_groups

    def describe(self) -> str:
        """e.g. "6 groups of 3 layers: 1 full, 5 sliding (window 512)"; empty for one full-attention group."""
        if self.windows == (None,):
            return ""
        full = sum(w is None for w in self.windows)
        sliding = sorted({w for w in self.windows if w is not None})
        kinds = ([f"{full} full"] if full else []) + [
            f"{sum(w == s for w in self.windows)} sliding (window {s:,})" for s in sliding]
        noun = "group" if self.num_groups == 1 else "groups"
        return f"{self.num_groups} {noun} of {self.layers_per_block} layers: {', '.join(kinds)}"
