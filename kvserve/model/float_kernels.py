"""Who multiplies float weights on this CPU: PyTorch's BLAS call, or oneDNN's linear over a copy of each weight
packed for it once at load, chosen by a start-up probe.

`F.linear` is MKL's GEMM on x86, which at the few rows of a decode step keeps to one core on the AMD EPYCs and reads
the weights at about half the memory bandwidth that two cores reach; oneDNN's linear (`torch.ops.mkldnn`, PyTorch's
own kernels, what Inductor's freezing packs float weights for) over its packed copy used both, at every batch size
measured (docs/benchmarks.md, "oneDNN's float linear"). Which is faster depends on the CPU and the shapes, so a short
probe times both on the model's shapes per dtype (probe_shapes.py); oneDNN is used only where it wins at one token and
at 64. The choice is remembered for later starts on the same machine and model shapes (route_cache.py), and the
start-up log says which route runs and why. The two
add their sums in another order (a few float32 ulps apart); --batch-invariant keeps the BLAS call, whose fixed tiles
its bitwise guarantee was measured with."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.model import route_cache
from kvserve.model.probe_shapes import FIXED, WeightShapes, token_time

logger = logging.getLogger("kvserve")

PROBE_ROWS = (1, 64)  # tokens per call: one decode step, and a batched step


class BlasMatmul:
    """F.linear over the weight as it is (the dense weight is what the layer keeps)."""

    name = "F.linear"
    library = "PyTorch's BLAS call (MKL on x86)"

    def available(self, dtype: torch.dtype) -> bool:
        return True

    def pack(self, weight: torch.Tensor) -> None:
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def storages(self, packed) -> dict[int, int]:
        return {}


class OneDNNMatmul:
    """oneDNN's linear over a packed copy of the weight (an opaque oneDNN tensor, one element per weight), which
    replaces the dense weight in the layer. In a compiled graph it is an op of kvserve's own (_onednn_linear) that
    Inductor calls as is."""

    name = "oneDNN linear"
    library = "oneDNN's linear over weights packed for it at load (torch.ops.mkldnn)"

    def available(self, dtype: torch.dtype) -> bool:
        if not torch.backends.mkldnn.is_available():
            return False
        weight = torch.eye(16, dtype=dtype)
        try:
            y = self.linear(torch.ones(2, 16, dtype=dtype), None, self.pack(weight), None)
        except (RuntimeError, AttributeError, NotImplementedError):
            return False
        return bool(torch.equal(y, torch.ones(2, 16, dtype=dtype)))

    def pack(self, weight: torch.Tensor) -> torch.nn.Parameter:
        # an nn.Parameter, as the dense weights are: what a compiled graph lifts as its input
        return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach()), requires_grad=False)

    def linear(self, x: torch.Tensor, weight, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = _onednn_linear(rows, packed, bias) if torch.compiler.is_compiling() else _onednn_linear_eager(rows, packed,
                                                                                                          bias)
        return y.view(*x.shape[:-1], y.shape[-1])  # not -1: a call may have no rows

    def storages(self, packed: torch.Tensor) -> dict[int, int]:
        return {id(packed): packed.numel() * packed.element_size()}  # opaque: no storage to ask, keyed by the object


@torch.library.custom_op("kvserve::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear as an op of kvserve's own inside a compiled graph: Inductor calls it as is."""
    return _onednn_linear_eager(x, packed, bias)


@_onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def _onednn_linear_eager(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_empty((0, packed.shape[0]))
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")


FloatMatmul = BlasMatmul | OneDNNMatmul
BLAS = BlasMatmul()
MATMULS = (OneDNNMatmul(),)


@dataclass(frozen=True)
class MatmulChoice:
    matmul: FloatMatmul
    dtype: torch.dtype
    speedup_by_rows: dict[int, float] = field(default_factory=dict)  # F.linear's time / the winner's
    probed_at: str | None = None  # when the remembered probe ran (route_cache.py); None: probed by this process

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        why = "probed now" if self.probed_at is None else f"remembered from the probe of {self.probed_at}"
        if not self.speedup_by_rows:
            return f"{dtype} matmuls: {self.matmul.name}, {self.matmul.library} (nothing else beat it here; {why})"
        speeds = ", ".join(f"{s:.1f}x F.linear at {m} token{'s' if m > 1 else ''}"
                           for m, s in self.speedup_by_rows.items())
        return f"{dtype} matmuls: {self.matmul.name}, {self.matmul.library}; {why}: {speeds}"


@functools.cache
def choose_matmul(dtype: torch.dtype, shapes: WeightShapes = FIXED) -> FloatMatmul:
    """The fastest route for float weights of `dtype` and a model's `shapes` on this CPU (remembered, or probed once
    per process, dtype and shapes)."""
    started = time.perf_counter()
    choice = remembered_or_probed(dtype, shapes=shapes)
    took = "" if choice.probed_at else f" (the probe took {time.perf_counter() - started:.1f} s)"
    logger.info(choice.describe() + took)
    return choice.matmul


def remembered_or_probed(dtype: torch.dtype, matmuls=MATMULS, shapes: WeightShapes = FIXED) -> MatmulChoice:
    """The choice the route file remembers for this machine, dtype and shapes (route_cache.py), if its route is still
    available; else probe_matmuls', written to the file for the next start."""
    routes = {matmul.name: matmul for matmul in (BLAS, *matmuls)}
    entry = route_cache.entry_name(str(dtype).removeprefix("torch."), shapes)
    probe = {"shapes": shapes.key(), "rows": PROBE_ROWS, "routes": sorted(routes)}
    key = route_cache.probe_key(entry, probe)
    found = route_cache.recall(entry, key, set(routes))
    if found is not None:
        matmul = routes[found.route]
        if matmul.available(dtype):
            return MatmulChoice(matmul, dtype, found.speedup_by_rows, found.probed_at)
        logger.warning(f"remembered {entry} matmul route {matmul.name} is not available here; probing again")
    choice = probe_matmuls(dtype, matmuls, shapes)
    route_cache.remember(entry, key, choice.matmul.name, choice.speedup_by_rows)
    return choice


def probe_matmuls(dtype: torch.dtype, matmuls=MATMULS, shapes: WeightShapes = FIXED) -> MatmulChoice:
    """Time F.linear and each route on weights of the model's `shapes` (probe_shapes.py) at PROBE_ROWS tokens; a route
    wins only if it beats F.linear at every size, the best mean speedup of those."""
    gen = torch.Generator().manual_seed(0)
    timed = shapes.timed(torch.empty((), dtype=dtype).element_size())
    weights = [[torch.randn(s.rows, s.cols, generator=gen).to(dtype) for _ in range(s.copies)] for s in timed]
    blas: dict[int, float] = {}
    best: MatmulChoice | None = None
    for matmul in (m for m in matmuls if m.available(dtype)):
        packed = [[matmul.pack(w) for w in copies] for copies in weights]
        speedups = {}
        for rows in PROBE_ROWS:
            x = [torch.randn(rows, s.cols, generator=gen).to(dtype) for s in timed]
            if rows not in blas:
                blas[rows] = token_time(timed, weights, x, F.linear)
            speedups[rows] = blas[rows] / token_time(timed, packed, x, lambda x, p: matmul.linear(x, None, p, None))
            if speedups[rows] <= 1.0:  # cannot win: not timed at more tokens
                break
        mean = sum(speedups.values()) / len(speedups)
        if min(speedups.values()) > 1.0 and (best is None or mean > sum(best.speedup_by_rows.values()) /
                                             len(best.speedup_by_rows)):
            best = MatmulChoice(matmul, dtype, speedups)
    return best or MatmulChoice(BLAS, dtype)
