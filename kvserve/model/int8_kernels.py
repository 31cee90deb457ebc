"""Who multiplies int8 by int8 on this CPU: PyTorch's maintained kernels, chosen by a start-up probe.

Every route returns the same thing, the integer sums sum_k qx[m, k] qw[n, k] as float32, so the choice changes
speed and never results. Which one is fast depends on the CPU (AMX, AVX-512 VNNI or AVX2 only: see
docs/benchmarks.md) and on the shapes, so a short probe times each on the model's shapes (probe_shapes.py) against a
float32 matmul and the fastest wins; when none beats float32 the codes are multiplied as float32 (same numbers,
float32's speed). The choice is remembered for later starts on the same machine and model shapes (route_cache.py),
and the start-up log says which route runs and why."""
from __future__ import annotations

import functools
import itertools
import logging
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from kvserve.model import route_cache
from kvserve.model.probe_shapes import FIXED, WeightShapes, token_time

logger = logging.getLogger("kvserve")

PROBE_ROWS = (1, 64)  # tokens per call: one decode step, and a batched step


class Int8Kernel:
    """pack() once per weight [N, K] int8; matmul() per call: int8 [M, K] x packed -> float32 [M, N] sums."""

    name = "?"
    library = "?"
    copies_codes = True  # pack() makes its own copy of the codes (False: a view of them)
    # Inductor lowers this kernel's calls over weights frozen into a graph (--compile-gemms) to its own C++ GEMM
    inductor_template = False
    # a compiled graph sums one row's codes in a loop of its own (model/linear.py, one_row_sums) instead of calling
    # this kernel, which at one row costs more than the loop: oneDNN's (an op of kvserve's own in a graph) on the Intel
    # Xeon, torch._int_mm's on the AMD EPYC of CPU family 25 (docs/benchmarks.md); FBGEMM's is called as oneDNN's is.
    # The float32 fallback's codes are float weights: no integer loop
    loops_at_one_row = True

    def available(self) -> bool:
        """Present here and exact: full-range codes, whose pairwise sums overflow an int16 (oneDNN on a CPU without
        VNNI adds pairs of products in int16 and saturates: there it returns wrong sums, and is not used)."""
        weight = torch.full((4, 64), 127, dtype=torch.int8)
        weight[1], weight[2, ::2] = -127, -127
        x = torch.full((2, 64), 127, dtype=torch.int8)
        x[1, 1::2] = -127
        try:
            sums = self.matmul(x, self.pack(weight))
        except (RuntimeError, AttributeError, NotImplementedError):
            return False
        return torch.equal(sums, (x.long() @ weight.long().t()).float())

    def pack(self, weight: torch.Tensor):
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, packed) -> torch.Tensor:
        raise NotImplementedError

    def storages(self, packed) -> dict[int, int]:
        """{storage address: bytes} of what the packed form holds (for weight memory)."""
        return {packed.untyped_storage().data_ptr(): packed.untyped_storage().nbytes()}


class IntMMKernel(Int8Kernel):
    name = "torch._int_mm"
    library = "PyTorch int8 GEMM (oneDNN on x86)"
    copies_codes = False

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        # W^T over the codes' own storage, no second copy: a tensor of its own rather than the view weight.t(), since a
        # compiled graph wraps a view's base as well, for every layer its one traced layer is reused for
        n, k = weight.shape
        return torch.empty(0, dtype=weight.dtype, device=weight.device).set_(
            weight.untyped_storage(), weight.storage_offset(), (k, n), (1, k))

    def matmul(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(x, packed).float()


class OneDNNKernel(Int8Kernel):
    """oneDNN's quantized linear. In a graph that freezes the weights (--compile-gemms), its op as it is, which
    Inductor lowers to its C++ GEMM template (AMX or VNNI micro-kernels, no oneDNN call); in any other graph, an op
    of kvserve's own that Inductor calls as is (_onednn_sums). The packed weight and its unit scales are
    nn.Parameters, as the float weights are, for freezing to lift them as the graph's constants."""

    name = "onednn.qlinear"
    library = "oneDNN quantized linear (PyTorch's x86 inductor kernel)"
    inductor_template = True

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (_frozen(torch.ops.onednn.qlinear_prepack(weight, None)), *_unit_scales(weight.shape[0]))

    def matmul(self, x: torch.Tensor, packed) -> torch.Tensor:
        # Inductor's freezing flag is set while a frozen graph traces (compile/inductor.py, freezing)
        if torch.compiler.is_compiling() and not torch._inductor.config.freezing:
            return _onednn_sums(x, *packed)
        return _onednn_sums_eager(x, *packed)

    def storages(self, packed) -> dict[int, int]:
        # oneDNN's reordered copy of the codes is an opaque tensor: one byte per weight, keyed by the object
        weight, ones, zeros = packed
        return {id(weight): weight.numel(), ones.data_ptr(): ones.nbytes, zeros.data_ptr(): zeros.nbytes}


@torch.library.custom_op("kvserve::onednn_int8_sums", mutates_args=())
def _onednn_sums(x: torch.Tensor, weight: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """oneDNN's quantized linear as an op of kvserve's own inside a compiled graph whose weights are its inputs:
    Inductor lowers oneDNN's op only over a weight frozen into the graph as a constant (it fails on one the graph
    reaches through the model). An op it does not know it calls as is."""
    return _onednn_sums_eager(x, weight, ones, zeros)


@_onednn_sums.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], ones.shape[0]), dtype=torch.float32)


def _onednn_sums_eager(x: torch.Tensor, weight: torch.Tensor, ones: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, weight, ones, zeros, None, 1.0, 0, torch.float32, "none",
                                              [None], "")


@functools.cache
def _unit_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight scales 1 and zero points 0 for n channels, so oneDNN returns the bare integer sums; shared by size."""
    return _frozen(torch.ones(n)), _frozen(torch.zeros(n, dtype=torch.long))


def _frozen(tensor: torch.Tensor) -> torch.nn.Parameter:
    """A tensor as an nn.Parameter over the same storage, no gradient: what Inductor's freezing lifts."""
    return torch.nn.Parameter(tensor, requires_grad=False)


class FbgemmKernel(Int8Kernel):
    """FBGEMM's quantized linear (PyTorch's x86 quantized backend): the activation codes shifted to uint8 by a zero
    point of 128, times the weight's codes with unit scales, summed in int32. Its packed weight is a TorchScript
    object, which a compiled graph cannot hold: a layer holds a handle instead (a tensor of the weight's N rows, one
    number repeated), and an op of kvserve's own (_fbgemm_sums) finds the packed weight by that number."""

    name = "fbgemm linear"
    library = "FBGEMM's u8s8 linear (torch.ops.quantized, x86)"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        # torch 2.13 deprecates quantized tensors (a warning at every start); once they are gone, available() fails
        # and the probe passes this route by
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            codes = torch._make_per_channel_quantized_tensor(weight, torch.ones(n, dtype=torch.double),
                                                             torch.zeros(n, dtype=torch.long), 0)
        number = next(_FBGEMM_NUMBERS)
        # a tensor of its own over one element, not a view: a compiled graph wraps a view's base as well
        handle = torch.empty(0, dtype=torch.long).set_(torch.tensor([number]).untyped_storage(), 0, (n,), (0,))
        _FBGEMM_WEIGHTS[number] = (torch.ops.quantized.linear_prepack(codes, None), n * k)
        weakref.finalize(handle, _FBGEMM_WEIGHTS.pop, number, None)  # the packed weight lives as long as its layer
        return handle

    def matmul(self, x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        return _fbgemm_sums(x, handle) if torch.compiler.is_compiling() else _fbgemm_sums_eager(x, handle)

    def storages(self, handle: torch.Tensor) -> dict[int, int]:
        packed, nbytes = _FBGEMM_WEIGHTS[int(handle[0])]
        return {id(packed): nbytes}  # opaque: one byte per weight, keyed by the object


_FBGEMM_WEIGHTS: dict[int, tuple] = {}  # handle number -> (FBGEMM's packed weight, its bytes)
_FBGEMM_NUMBERS = itertools.count()


@torch.library.custom_op("kvserve::fbgemm_int8_sums", mutates_args=())
def _fbgemm_sums(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """FBGEMM's linear as an op of kvserve's own inside a compiled graph: Inductor calls it as is."""
    return _fbgemm_sums_eager(x, handle)


@_fbgemm_sums.register_fake
def _(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], handle.shape[0]), dtype=torch.float32)


def _fbgemm_sums_eager(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    packed, _ = _FBGEMM_WEIGHTS[int(handle[0])]
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x.float(), 1.0, 128, packed)


# K columns whose int8 products add up exactly in float32, in any order: 1040 * 127^2 < 2^24
EXACT_FLOAT_COLUMNS = 1040


class FloatKernel(Int8Kernel):
    """The fallback: the codes multiplied as float32. Every partial sum of up to EXACT_FLOAT_COLUMNS products is an
    integer below 2^24, so each slice of columns sums exactly whatever the BLAS's order; the slices' sums are added
    in one fixed order. So a row's result never depends on the rows beside it, as with the integer kernels."""

    name = "float32 matmul of the int8 codes"
    loops_at_one_row = False

    def __init__(self, reason: str = "no int8 kernel beat float32 here"):
        self.reason = reason  # why the codes are multiplied as float32 (the start-up line says it)
        self.library = f"fallback: {reason}"

    def pack(self, weight: torch.Tensor) -> list[torch.Tensor]:
        # nn.Parameters, as the float weights are, for the compiled decode step's --compile-gemms to freeze (the
        # sums stay exact in whatever order its GEMM adds them)
        return [torch.nn.Parameter(weight[:, k : k + EXACT_FLOAT_COLUMNS].float().contiguous(), requires_grad=False)
                for k in range(0, weight.shape[1], EXACT_FLOAT_COLUMNS)]

    def matmul(self, x: torch.Tensor, packed: list[torch.Tensor]) -> torch.Tensor:
        x = x.float()
        sums = x[:, :EXACT_FLOAT_COLUMNS] @ packed[0].t()
        for i, part in enumerate(packed[1:], start=1):
            sums += x[:, i * EXACT_FLOAT_COLUMNS : (i + 1) * EXACT_FLOAT_COLUMNS] @ part.t()
        return sums

    def storages(self, packed: list[torch.Tensor]) -> dict[int, int]:
        return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in packed}


KERNELS: tuple[Int8Kernel, ...] = (IntMMKernel(), OneDNNKernel(), FbgemmKernel())


@dataclass(frozen=True)
class KernelChoice:
    kernel: Int8Kernel
    speedup_by_rows: dict[int, float] = field(default_factory=dict)  # the winner's float32 time / its time
    probed_at: str | None = None  # when the remembered probe ran (route_cache.py); None: probed by this process

    def describe(self) -> str:
        why = "probed now" if self.probed_at is None else f"remembered from the probe of {self.probed_at}"
        if isinstance(self.kernel, FloatKernel):
            return f"int8 matmuls: {self.kernel.name} ({self.kernel.library} on this CPU; {why})"
        speeds = ", ".join(f"{s:.1f}x float32 at {m} token{'s' if m > 1 else ''}"
                           for m, s in self.speedup_by_rows.items())
        return f"int8 matmuls: {self.kernel.name}, {self.kernel.library}; {why}: {speeds}"


@functools.cache
def choose_kernel(shapes: WeightShapes = FIXED) -> Int8Kernel:
    """The fastest available route on this CPU for a model's `shapes` (remembered, or probed once per process and
    shapes); the fallback if none beats float32."""
    started = time.perf_counter()
    choice = remembered_or_probed(shapes=shapes)
    took = "" if choice.probed_at else f" (the probe took {time.perf_counter() - started:.1f} s)"
    logger.info(choice.describe() + took)
    return choice.kernel


def remembered_or_probed(kernels: tuple[Int8Kernel, ...] = KERNELS, shapes: WeightShapes = FIXED) -> KernelChoice:
    """The choice the route file remembers for this machine and shapes (route_cache.py), if its kernel still passes
    available(); else probe_kernels', written to the file for the next start."""
    fallback = FloatKernel()
    routes = {kernel.name: kernel for kernel in (*kernels, fallback)}
    entry = route_cache.entry_name("int8", shapes)
    probe = {"shapes": shapes.key(), "rows": PROBE_ROWS, "kernels": sorted(routes)}
    key = route_cache.probe_key(entry, probe)
    found = route_cache.recall(entry, key, set(routes))
    if found is not None:
        kernel = routes[found.route]
        if kernel.available():
            return KernelChoice(kernel, found.speedup_by_rows, found.probed_at)
        logger.warning(f"remembered int8 matmul route {kernel.name} failed its check here; probing again")
    choice = probe_kernels(kernels, shapes)
    route_cache.remember(entry, key, choice.kernel.name, choice.speedup_by_rows)
    return choice


def probe_kernels(kernels: tuple[Int8Kernel, ...] = KERNELS, shapes: WeightShapes = FIXED) -> KernelChoice:
    """Time each kernel and float32 on weights of the model's `shapes` (probe_shapes.py, as many as fill the probe's
    bytes in float32, the larger of the two copies) at PROBE_ROWS tokens; the winner has the best mean speedup."""
    gen = torch.Generator().manual_seed(0)
    timed = shapes.timed(torch.empty((), dtype=torch.float32).element_size())
    weights = [[torch.randint(-127, 128, (s.rows, s.cols), dtype=torch.int8, generator=gen) for _ in range(s.copies)]
               for s in timed]
    inputs = {m: [torch.randint(-127, 128, (m, s.cols), dtype=torch.int8, generator=gen) for s in timed]
              for m in PROBE_ROWS}
    float_times: dict[int, float] = {}
    best: KernelChoice | None = None
    for kernel in (kn for kn in kernels if kn.available()):
        packed = [[kernel.pack(w) for w in copies] for copies in weights]
        speedups = {}
        for m in PROBE_ROWS:
            if m not in float_times:
                float_times[m] = _float_time(timed, weights, inputs[m])
            speedups[m] = float_times[m] / token_time(timed, packed, inputs[m], kernel.matmul)
            # a winner beats float32 at every size probed: this one cannot win, and is not timed at more tokens
            # (oneDNN's quantized linear on the AVX-512 AMD EPYC, far slower than float32 at 64 tokens, was most of
            # an int8 start: docs/benchmarks.md, "Start-up side by side")
            if speedups[m] <= 1.0:
                break
        mean = sum(speedups.values()) / len(speedups)
        if min(speedups.values()) > 1.0 and (best is None or mean > _mean(best)):
            best = KernelChoice(kernel, speedups)
    return best or KernelChoice(FloatKernel())


def _float_time(timed, weights: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> float:
    """The codes multiplied as float32 (the fallback's speed), one shape's float copies held at a time."""
    return sum(token_time([shape], [[w.float() for w in copies]], [x.float()], torch.nn.functional.linear)
               for shape, copies, x in zip(timed, weights, inputs))


def _mean(choice: KernelChoice) -> float:
    return sum(choice.speedup_by_rows.values()) / len(choice.speedup_by_rows)
