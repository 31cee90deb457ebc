"""Lloyd-Max codebooks for the coordinates of a rotated head vector, and the bit packing of their codes.

Divided by its RMS (its norm / sqrt(dim)), a vector lies on the sphere of radius sqrt(dim); rotated by a fixed
orthonormal matrix, its coordinates follow, for a direction spread evenly over the sphere, the distribution of
sqrt(dim) * t with density proportional to (1 - t^2)^((dim - 3) / 2) (a scaled Beta, close to a standard normal
for dim 64). The codebook with the least mean squared error for that density (Lloyd-Max) puts more levels near
zero, where most coordinates are, than an evenly spaced grid does. It is computed here once, in float64, from the
density alone: no data is fitted, and the same dim and bits always give the same levels (TurboQuant's MSE
quantizer, arXiv 2504.19874).

Packing keeps each vector's codes in its own bytes (a slot is one token's), in planes a vectorized shift unpacks:
- 4 bits: byte j holds channel j (low nibble) and channel j + dim/2 (high nibble);
- 3 bits: the low two bits of every code, four per byte (byte j: channels j + i * dim/4 at bits 2i), then the high
  bit, eight per byte (byte j: channels j + i * dim/8 at bit i): dim / 4 + dim / 8 bytes, 8 codes in 3 bytes."""
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


def codebook(dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels [2**bits], midpoints between neighbouring levels [2**bits - 1]) in float32."""
    levels = torch.tensor(lloyd_max_levels(dim, bits), dtype=torch.float64)
    return levels.float(), ((levels[1:] + levels[:-1]) / 2).float()


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes of one vector's packed codes."""
    return dim * bits // 8


def check_packable(dim: int, bits: int) -> None:
    """Raises ValueError unless `dim` channels pack into whole bytes of `bits`-bit codes (see the module's planes)."""
    per_plane = {4: 2, 3: 8}[bits]
    if dim % per_plane:
        raise ValueError(f"{bits}-bit codes pack {per_plane} channels of a vector per byte plane: head_dim {dim} "
                         f"must be a multiple of {per_plane}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., dim] (each < 2**bits) -> [..., packed_bytes(dim, bits)] bytes."""
    if bits == 4:
        return _pack_plane(codes, 2, 4)
    return torch.cat([_pack_plane(codes & 3, 4, 2), _pack_plane(codes >> 2, 8, 1)], dim=-1)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of pack: [..., packed_bytes(dim, bits)] bytes -> uint8 codes [..., dim]. Shifts and masks of
    whole planes only, so a compiled caller vectorizes them."""
    if bits == 4:
        return _unpack_plane(packed, 2, 4)
    low, high = packed[..., : dim // 4], packed[..., dim // 4:]
    return _unpack_plane(low, 4, 2) | (_unpack_plane(high, 8, 1) << 2)


def _pack_plane(codes: torch.Tensor, per_byte: int, width: int) -> torch.Tensor:
    """Channel j + i * dim/per_byte at bits [i * width, (i + 1) * width) of byte j."""
    parts = codes.unflatten(-1, (per_byte, -1))  # [..., per_byte, dim / per_byte]
    shifts = torch.arange(0, per_byte * width, width, dtype=torch.uint8, device=codes.device)
    return (parts << shifts[:, None]).sum(-2, dtype=torch.uint8)  # disjoint bits: the sum is their OR


def _unpack_plane(packed: torch.Tensor, per_byte: int, width: int) -> torch.Tensor:
    shifts = torch.arange(0, per_byte * width, width, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None, :] >> shifts[:, None]) & (2**width - 1)).flatten(-2)
