"""Lloyd-Max codebooks for the coordinates of a rotated head vector, and the bit packing of their codes.

Divided by its RMS (its norm / sqrt(dim)), a vector lies on the sphere of radius sqrt(dim); rotated by a fixed
orthonormal matrix, its coordinates follow, for a direction spread evenly over the sphere, the distribution of
sqrt(dim) * t with density proportional to (1 - t^2)^((dim - 3) / 2) (a scaled Beta, close to a standard normal
for dim 64). The codebook with the least mean squared error for that density (Lloyd-Max) puts more levels near
zero, where most coordinates are, than an evenly spaced grid does. It is computed here once, in float64, from the
density alone: no data is fitted, and the same dim and bits always give the same levels (TurboQuant's MSE
quantizer, arXiv 2504.19874). A read computes a code's level by a short polynomial (levels_of) instead of
looking it up, so that compiled loops over the codes vectorize.

A block's codes are packed across its tokens, channel by channel, as int4's are (formats.int4): a block of
block_size tokens becomes block_size * bits / 8 rows of bytes, each row [heads, head_dim] like a token's, so that a
compiled read unpacks whole rows of channels with one shift each and its loops over channels stay contiguous:
- 4 bits: row r holds token r (low nibble) and token r + block_size/2 (high nibble);
- 3 bits: block_size/4 rows of the low two bits (row r: token r + i * block_size/4 at bits 2i), then block_size/8
  rows of the high bit (row r: token r + i * block_size/8 at bit i): 8 codes in 3 bytes."""
from __future__ import annotations

from functools import lru_cache

import torch

GRID_POINTS = 200_001  # the density's samples over [-sqrt(dim), sqrt(dim)]
LLOYD_ITERATIONS = 300


@lru_cache(maxsize=None)
def lloyd_max_levels(dim: int, bits: int) -> tuple[float, ...]:
    """The 2**bits levels (ascending) of the least-squares quantizer of one coordinate of a vector spread evenly over
    the sphere of radius sqrt(dim); symmetric about 0."""
    if dim < 4:
        raise ValueError(f"a codebook needs a head_dim of at least 4, got {dim}")
    radius = dim**0.5
    x = torch.linspace(-radius, radius, GRID_POINTS, dtype=torch.float64)
    density = (1 - (x / radius) ** 2).clamp(min=0) ** ((dim - 3) / 2)
    n = 2**bits
    cdf = density.cumsum(0) / density.sum()
    levels = x[torch.searchsorted(cdf, (torch.arange(n, dtype=torch.float64) + 0.5) / n)]  # start at quantiles
    for _ in range(LLOYD_ITERATIONS):
        cell = torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, density)
        moment = torch.zeros(n, dtype=torch.float64).index_add_(0, cell, density * x)
        levels = moment / mass
    levels = (levels - levels.flip(0)) / 2  # exactly symmetric
    return tuple(levels.tolist())


def codebook(dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, tuple[float, ...]]:
    """(levels [2**bits], midpoints between neighbouring levels [2**bits - 1]) in float32, and the 2**(bits - 1)
    coefficients of levels_of. The levels are levels_of's values, within 1e-6 of lloyd_max_levels', so that a
    code is read back as the level it was chosen for."""
    coefficients = level_polynomial(dim, bits)
    levels = levels_of(torch.arange(2**bits), coefficients, bits)
    return levels, (levels[1:] + levels[:-1]) / 2, coefficients


def level_polynomial(dim: int, bits: int) -> tuple[float, ...]:
    """Coefficients c (ascending powers of y², float32 values as Python numbers) of the odd polynomial
    y (c0 + c1 y² + c2 y⁴ + ...) through the codebook's levels at y = the codes' offsets from the middle, mapped onto
    -1 ... 1 (see levels_of); solved in float64."""
    levels = torch.tensor(lloyd_max_levels(dim, bits), dtype=torch.float64)
    half = len(levels) // 2
    y = (torch.arange(half, dtype=torch.float64) + 0.5) / (half - 0.5)  # the positive levels' offsets
    powers = torch.stack([y * y ** (2 * k) for k in range(half)], dim=1)
    return tuple(torch.linalg.solve(powers, levels[half:]).float().tolist())


def levels_of(codes: torch.Tensor, coefficients: tuple[float, ...], bits: int) -> torch.Tensor:
    """The codebook's level of each code, float32, by arithmetic rather than a table lookup (which a compiled CPU
    loop loads element by element): the codebook is symmetric, so the level is an odd function of the code's offset
    from the middle, and its 2**bits levels lie on an odd polynomial of 2**(bits - 1) coefficients (exact at those
    points, evaluated by Horner's rule in y², y the offset mapped onto -1 ... 1). The coefficients are numbers, not a
    tensor, so a compiled loop holds them as constants: each element of a tensor was one more read, and the few
    operations are what keep the levels in the loop that reads the codes (Inductor stores a pointwise result of
    more than 12 reads or more than 50 operations in a buffer of its own on a CPU: the levels then went through
    memory twice before attention read them)."""
    half = 2 ** (bits - 1)
    y = (codes.float() - (half - 0.5)) * (1 / (half - 0.5))
    square = y * y
    level = square * coefficients[half - 1] + coefficients[half - 2]
    for k in range(half - 3, -1, -1):
        level = level * square + coefficients[k]
    return level * y


class NearestLevel:
    """The code of each value's nearest level: the count of midpoints below it, torch.bucketize(x, midpoints)'s
    answer, found without bucketize's binary search (which a CPU runs element by element, ~45 ns a value here).
    A table over an even grid of cells half the smallest gap between midpoints wide gives each cell's code, so a
    value's table code is off by at most one (a value and its cell's centre, however the cell index rounds, lie
    less than one gap apart: at most one midpoint between them); a comparison with the code's bound on each side
    corrects it. Each table is looked up with one index_select of float32 rows by int32 cells."""

    def __init__(self, midpoints: torch.Tensor):
        gap = float((midpoints[1:] - midpoints[:-1]).min()) if len(midpoints) > 1 else 1.0
        self.low, self.width = float(midpoints[0]) - gap, gap / 2
        self.cells = int((float(midpoints[-1]) + gap - self.low) / self.width) + 2  # the last centre above them all
        centres = self.low + (torch.arange(self.cells, dtype=torch.float64) + 0.5) * self.width
        codes = torch.bucketize(centres, midpoints.double().cpu())
        beyond = torch.full((1,), float("nan"))  # no comparison passes it: nothing below code 0 or above the last
        bounds = torch.cat([beyond, midpoints.float().cpu(), beyond])  # code c's values: (bounds[c], bounds[c + 1]]
        # per cell: its code, and the bounds of that code (float32 rows, as index_select reads fastest)
        self.table = torch.stack([codes.float(), bounds[codes], bounds[codes + 1]]).to(midpoints.device)

    def __call__(self, x: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 codes of float32 x (any shape); inf and -inf get the outer codes, as bucketize gives them, NaN 0.
        `table`: self.table, passed in by a compiled caller (a graph's argument, not a constant of it)."""
        cell = ((x - self.low) * (1 / self.width)).clamp_(0, self.cells - 1).nan_to_num_(0).to(torch.int32).view(-1)
        code, below, above = (row.index_select(0, cell).view(x.shape) for row in
                              (self.table if table is None else table))
        return code.add_(x > above).sub_((x <= below).view(torch.uint8)).to(torch.uint8)


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes of one vector's packed codes."""
    return dim * bits // 8


def packed_rows(block_size: int, bits: int) -> int:
    """Rows of bytes a block's packed codes take (each row one byte per head and channel)."""
    return block_size * bits // 8


def check_packable(block_size: int, bits: int, format_name: str = "") -> None:
    """Raises ValueError unless a block of `block_size` tokens packs into whole rows (see the module's planes)."""
    per_plane = {4: 2, 3: 8}[bits]
    if block_size % per_plane:
        raise ValueError(f"{format_name or f'{bits}-bit codes'} packs {per_plane} tokens of a block per byte plane: "
                         f"block_size {block_size} must be a multiple of {per_plane}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., block_size, heads, dim] (each < 2**bits) -> [..., packed_rows(block_size, bits), heads,
    dim] bytes."""
    if bits == 4:
        return _pack_plane(codes, 2, 4)
    return torch.cat([_pack_plane(codes & 3, 4, 2), _pack_plane(codes >> 2, 8, 1)], dim=-3)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of pack: [..., packed_rows, heads, dim] bytes -> uint8 codes [..., block_size, heads, dim]. Shifts
    and masks of whole rows only, so a compiled caller vectorizes them over the channels."""
    if bits == 4:
        return _unpack_plane(packed, 2, 4)
    quarter = packed.shape[-3] * 2 // 3  # rows of the two-bit plane: block_size / 4 of block_size * 3 / 8
    return _unpack_plane(packed[..., :quarter, :, :], 4, 2) | (_unpack_plane(packed[..., quarter:, :, :], 8, 1) << 2)


def _pack_plane(codes: torch.Tensor, per_byte: int, width: int) -> torch.Tensor:
    """Token r + i * block_size/per_byte at bits [i * width, (i + 1) * width) of row r."""
    parts = codes.unflatten(-3, (per_byte, -1))  # [..., per_byte, block_size / per_byte, heads, dim]
    shifts = torch.arange(0, per_byte * width, width, dtype=torch.uint8, device=codes.device)
    return (parts << shifts.view(-1, 1, 1, 1)).sum(-4, dtype=torch.uint8)  # disjoint bits: the sum is their OR


def _unpack_plane(packed: torch.Tensor, per_byte: int, width: int) -> torch.Tensor:
    shifts = torch.arange(0, per_byte * width, width, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-4) >> shifts.view(-1, 1, 1, 1)) & (2**width - 1)).flatten(-4, -3)
