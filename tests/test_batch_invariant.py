"""RowTiles: per-token work in tiles of a fixed number of rows, so a row's result does not depend on how many rows
share the call — the property batch-invariant mode builds on (the engine-level checks are in
tests/engine/test_batch_invariant_mode.py)."""
import pytest
import torch
import torch.nn.functional as F

from kvserve.batch_invariant import TILE_ROWS, RowTiles


def gaussian(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_without_rows_the_function_runs_once_on_the_whole_batch():
    seen = []
    out = RowTiles().map(lambda x: seen.append(x.shape[0]) or x * 2, gaussian(37, 4))
    assert seen == [37] and out.shape == (37, 4)
    assert not RowTiles() and RowTiles(8)


def test_every_call_gets_exactly_one_tile_and_the_rows_come_back_in_order():
    seen = []
    x, y = gaussian(37, 4), gaussian(37, 2, seed=1)

    def fn(a, b):
        seen.append((a.shape[0], b.shape[0]))
        return a.sum(-1, keepdim=True), b * 3

    first, second = RowTiles(16).map(fn, x, y)
    assert seen == [(16, 16)] * 3
    assert torch.equal(first, x.sum(-1, keepdim=True)) and torch.equal(second, y * 3)


def test_no_rows_give_no_rows():
    assert RowTiles(16).map(lambda t: t + 1, torch.zeros(0, 3)).shape == (0, 3)


def test_a_tile_needs_a_row():
    with pytest.raises(ValueError, match="a tile needs at least one row, got 0"):
        RowTiles(0)


# The premise, checked on the CPU that runs the tests: a kernel given one fixed shape computes each row alike,
# wherever the row sits in the call. Without tiles these ops differ here in the last bits for some batch sizes
# (a one-row matmul is a GEMV; silu and gelu compute a tensor's tail with scalar code).
OPS = {
    "linear 64->96": (lambda w: lambda x: F.linear(x, w))(gaussian(96, 64, seed=2)),
    "linear 64->1536": (lambda w: lambda x: F.linear(x, w))(gaussian(1536, 64, seed=3)),
    "silu": F.silu,
    "gelu tanh": lambda x: F.gelu(x, approximate="tanh"),
    "rms_norm": lambda x: F.rms_norm(x, (x.shape[-1],), eps=1e-6),
}


@pytest.mark.parametrize("op", OPS, ids=list(OPS))
def test_each_row_is_the_same_alone_or_in_any_batch_from_1_to_64(op):
    fn, tiles = OPS[op], RowTiles(TILE_ROWS)
    batch = gaussian(64, 64, seed=4) * torch.linspace(0.01, 100, 64)[:, None]
    alone = torch.cat([tiles.map(fn, batch[i : i + 1]) for i in range(64)])
    for size in range(1, 65):
        start = (size * 7) % (65 - size)
        assert torch.equal(tiles.map(fn, batch[start : start + size]), alone[start : start + size]), size
