"""Where a graph torch.compile traces should compute a result once and keep it.

Inductor inlines a cheap elementwise result into every loop that reads it, recomputing it for each element that
loop broadcasts it to. `in_buffer(x)` is `x` itself, which a traced graph holds in a buffer of its own (Inductor
lowers as_strided only over one), so it is computed once: the row a one-row matrix-vector loop reads for every
output (model/linear.py), a nuq block's key factor and shift that every key of the block reads
(kv/formats/nonuniform.py). Outside a graph it is a view, and changes nothing."""
from __future__ import annotations

import torch


def in_buffer(x: torch.Tensor) -> torch.Tensor:
    """`x`, held in a buffer of its own by a compiled graph (see the module's docstring)."""
    return x.as_strided(x.shape, x.stride())
