"""Batch invariance: a token's result must not depend on which other tokens share its step.

PyTorch's CPU kernels pick their code path by shape: a one-row matmul is a GEMV, a 33-row one a blocked GEMM with
other rounding; an elementwise op over a tensor whose length is not a multiple of the vector width computes its
tail with scalar code (silu, gelu and rsqrt round differently there); a reduction splits its work by the number
of rows. So the same row, alone or batched, can come out different in its last bits, and which ones do depends on
the CPU and its BLAS. In batch-invariant mode (`EngineConfig.batch_invariant`) kvserve makes every call's shape a
property of the model, never of the batch:

- every per-token computation (embedding, norms, linears, activations, the output head) runs on tiles of exactly
  `TILE_ROWS` tokens, the last one padded (`RowTiles`);
- attention runs per query tile of one KV block (the runner's tile calls, engine/attention_tiles.py), over exactly
  the keys that tile's positions reach, never padded to a neighbour's length, each position a one-row problem of
  its own (so a decoded token and the same position prefilled with its block are computed alike).

What remains is one property of a kernel given one fixed shape: it computes each row with the same operations,
whichever row of the call it is and whatever the other rows hold. Every BLAS and PyTorch kernel works that way
(rows are split among threads and vector lanes by position in a fixed pattern, and the arithmetic of one row does
not read another row), and tests/test_batch_invariant.py checks it on the CPU that runs them. int8 weights need
less: their integer sums are exact whatever the kernel (kvserve/model/int8_kernels.py), but their rotations and
the float parts around them are still tiled.

The price is measured in docs/benchmarks.md ("Batch invariance"): padding a one-token decode to a tile costs a
single stream most, so the mode is off by default."""
from __future__ import annotations

from collections.abc import Callable

import torch

TILE_ROWS = 16  # tokens per tile: 16 float32 rows start every tile on a 64-byte boundary for any row length


class RowTiles:
    """Runs a per-token function over the first dimension of its inputs: whole (rows=None, the default mode), or
    in tiles of exactly `rows` tokens, the last one padded with zeros, so every kernel it calls sees one shape."""

    def __init__(self, rows: int | None = None):
        if rows is not None and rows < 1:
            raise ValueError(f"a tile needs at least one row, got {rows}")
        self.rows = rows

    def __bool__(self) -> bool:
        return self.rows is not None

    def map(self, fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], *inputs: torch.Tensor):
        """fn(*inputs), computed tile by tile: fn must treat rows independently (one token each) and return a
        tensor or a tuple of tensors with one row per input row."""
        if self.rows is None:
            return fn(*inputs)
        num_rows, rows = inputs[0].shape[0], self.rows
        padded = [_pad_rows(x, -(-num_rows // rows) * rows) for x in inputs]
        outs = [fn(*(x[i : i + rows] for x in padded)) for i in range(0, max(num_rows, 1), rows)]
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)[:num_rows]
        return tuple(torch.cat(parts)[:num_rows] for parts in zip(*outs))


def _pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x with zero rows appended up to `num_rows` (x itself when it has them)."""
    if x.shape[0] == num_rows:
        return x
    padded = x.new_zeros(num_rows, *x.shape[1:])
    padded[: x.shape[0]] = x
    return padded
