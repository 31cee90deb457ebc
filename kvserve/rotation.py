"""Orthonormal rotations: those that spread a vector's energy over all its channels before it is quantized, and
RoPE's (apply_rotary), which the models and StreamingLLM's sink scoring (kv/scored_attention.py) both apply.

A few large channels (outliers) set a per-row scale and leave the other channels only a few quantization levels;
rotated, every channel carries a share of them. Used by the fp8 KV cache (kvserve/kv/formats/fp8.py) and by int8
weights with int8 activations (kvserve/model/linear.py)."""
from __future__ import annotations

from functools import lru_cache

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by RoPE's angles (HF's rotate-half layout): cos and sin broadcast over x's last dimension."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def hadamard(size: int) -> torch.Tensor:
    """An orthonormal [size, size] rotation: Sylvester's Hadamard matrix / sqrt(size) for a power of two, else a
    fixed random orthogonal matrix."""
    if size & (size - 1) == 0:
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < size:
            matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
        return matrix / size**0.5
    gaussian = torch.randn(size, size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return torch.linalg.qr(gaussian).Q.float().contiguous()


class KroneckerRotation:
    """R = kron(A, H) over `size` channels: H a Hadamard matrix over blocks of `block` channels (a power of two,
    at most 64 and at most half of `size`) and A a rotation across the size/block blocks, so R is dense yet costs
    two small matmuls per row (size x (block + size/block) multiply-adds) instead of size x size.

    x R is computed for a batch [M, size] as two matmuls over all M rows: a row's last bits may depend on M (the
    BLAS picks its path by shape), unless the caller fixes M (kvserve/batch_invariant.py's RowTiles)."""

    def __init__(self, size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        block = min(size & -size, 64, size // 2)  # the largest power of two dividing size, capped
        if block < 2:
            raise ValueError(f"a rotation needs an even number of channels, got {size}")
        self.size, self.block, self.num_blocks = size, block, size // block
        self.within = hadamard(block).to(dtype=dtype, device=device)
        self.across = hadamard(self.num_blocks).to(dtype=dtype, device=device)
        # their transposes as tensors of their own: a graph whose layers are one region called once per layer
        # (compile/steps.py) takes no two views of one tensor as inputs, as `.T` of a shared rotation was
        self.within_t, self.across_t = self.within.T.contiguous(), self.across.T.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x R for x [M, size]."""
        return self._apply(x, self.within, self.across_t)

    def invert(self, x: torch.Tensor) -> torch.Tensor:
        """x R^T (R is orthonormal: its inverse)."""
        return self._apply(x, self.within_t, self.across)

    def _apply(self, x: torch.Tensor, within: torch.Tensor, across: torch.Tensor) -> torch.Tensor:
        """across @ (x's blocks @ within), per row. Eagerly two batched BLAS matmuls; inside a compiled graph
        (compile/steps.py) two sums of products, which Inductor turns into loops of its own fused with the
        quantization that follows: SmolLM2's int8 decode step rotates 121 inputs, and as BLAS calls they were 242 of
        its graph's calls (Inductor's code for it, docs/benchmarks.md). The sums are added in another order than
        the BLAS's: a few float32 ulps, like the graph's other fused reductions."""
        blocks = x.reshape(-1, self.num_blocks, self.block)
        if torch.compiler.is_compiling():
            t = (blocks[..., None] * within).sum(2)  # t[m, i, j] = sum_k blocks[m, i, k] within[k, j]
            return (across[:, :, None] * t[:, None]).sum(2).reshape(x.shape)
        return torch.matmul(across, blocks @ within).reshape(x.shape)

    def matrix(self) -> torch.Tensor:
        return torch.kron(self.across, self.within)

    def storages(self) -> dict[int, int]:
        tensors = (self.within, self.across, self.within_t, self.across_t)
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@lru_cache(maxsize=None)
def kronecker_rotation(size: int, dtype: torch.dtype, device: str) -> KroneckerRotation:
    """One rotation per (size, dtype, device), shared by every linear that reads `size` channels."""
    return KroneckerRotation(size, dtype, device)
