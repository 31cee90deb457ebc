"""The rotations used before quantizing (fp8 KV, int8 activations): orthonormal, inverted exactly enough, dense,
computed in a compiled graph as Inductor's own loops (no BLAS call) to within float32 rounding of eager's, and,
computed in fixed tiles, each row's result independent of the rows it is batched with."""
import pytest
import torch

from kvserve.batch_invariant import TILE_ROWS, RowTiles
from kvserve.rotation import KroneckerRotation, hadamard


@pytest.mark.parametrize("size", [2, 8, 9, 64, 576])
def test_hadamard_is_orthonormal(size):
    matrix = hadamard(size).double()
    assert torch.allclose(matrix @ matrix.T, torch.eye(size, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("size", [4, 16, 64, 96, 576, 1536])
def test_kronecker_rotation_is_the_dense_product_and_inverts(size):
    rotation = KroneckerRotation(size)
    x = torch.randn(5, size, generator=torch.Generator().manual_seed(size))
    assert torch.allclose(rotation(x), x @ rotation.matrix(), atol=1e-4)
    assert torch.allclose(rotation.invert(rotation(x)), x, atol=1e-4)
    assert (rotation.matrix().abs() > 0).all()  # dense: every output channel mixes every input channel


@pytest.mark.parametrize("size", [4, 64, 576, 1536])
def test_each_row_is_rotated_the_same_alone_or_batched_in_fixed_tiles(size):
    rotation, tiles = KroneckerRotation(size), RowTiles(TILE_ROWS)
    x = torch.randn(33, size, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 100, 33)[:, None]
    together = tiles.map(rotation, x)
    assert torch.allclose(together, rotation(x), atol=1e-4)
    for i in (0, 1, 16, 32):
        assert torch.equal(tiles.map(rotation, x[i : i + 1]), together[i : i + 1])
        assert torch.equal(tiles.map(rotation, x[: i + 1])[i], together[i])


@pytest.mark.parametrize("size", [64, 576])
def test_a_compiled_graph_rotates_in_loops_of_its_own_as_eager_does(size):
    rotation = KroneckerRotation(size)
    x = torch.randn(3, size, generator=torch.Generator().manual_seed(2)) * 10
    compiled = torch.compile(lambda rows: (rotation(rows), rotation.invert(rows)), dynamic=False)
    code = torch._inductor.utils.run_and_get_code(compiled, x)[1]
    for got, expected in zip(compiled(x), (rotation(x), rotation.invert(x))):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert not any(call in "".join(code) for call in ("extern_kernels.mm", "extern_kernels.bmm")), "a BLAS call"


def test_an_odd_size_is_refused():
    with pytest.raises(ValueError, match="even number of channels, got 7"):
        KroneckerRotation(7)
