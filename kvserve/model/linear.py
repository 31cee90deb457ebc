"""A decoder's matmuls and embedding table, as the model dtype or as int8 (EngineConfig.quantization).

int8 is W8A8: weights in int8 with one float32 scale per output channel, and each call quantizes its input per
row (token), y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] qw[n, k]. The integer sums are exact, so every kernel route
gives the same numbers whichever tokens share the call: the route (kvserve/model/int8_kernels.py) is only a
question of speed. (The rotation below is a float matmul: bitwise batch invariance also needs it in fixed tiles,
kvserve/batch_invariant.py.)

Both sides are rotated first (x W^T = (x R)(W R)^T for an orthonormal R, kvserve/rotation.py): a decoder's
activations have a few channels far larger than the rest, which set the per-token scale and leave the others a
handful of levels. Rotated, the outliers are spread over every channel: on SmolLM2 this took W8A8's perplexity
cost from +4.61% to +0.75% (docs/quality.md). R is a Kronecker product of two small Hadamard-type matrices, so the
rotation of x costs two small matmuls; W R is computed once at load."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.graph_buffers import in_buffer
from kvserve.kv.formats.compiled import CompiledFunction
from kvserve.model.float_kernels import BLAS, FloatMatmul, choose_matmul
from kvserve.model.int8_kernels import EXACT_FLOAT_COLUMNS, FloatKernel, Int8Kernel, choose_kernel
from kvserve.model.probe_shapes import FIXED, WeightShapes
from kvserve.rotation import KroneckerRotation, kronecker_rotation

INT8_MAX = 127
# weight dtypes whose product with one row a compiled graph writes as a loop of Inductor's own (one_row_in_graph):
# measured faster than the BLAS call in the graph on the AVX-512 EPYC, float32 and bfloat16 (docs/benchmarks.md)
GRAPH_MATRIX_VECTOR_DTYPES = (torch.float32, torch.bfloat16)
MIN_AMAX = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class WeightsPolicy:
    """How a decoder holds and multiplies its weights, decided once at start and handed to build_model: cast to
    `dtype` on `device`, as they are or as int8 (`quantization`, above), float weights multiplied by the BLAS call
    where `batch_invariant` (kvserve/batch_invariant.py) and off the CPU, by the start-up probe's choice otherwise
    (float_kernels.py); `dense_in_graph`: float weights that a packed route multiplies are kept dense too, for a
    compiled graph's one-row loops (Linear's keep_dense); `eager_one_row`: steps that run eagerly while compiling is
    on multiply one row by the same loop, compiled on its own (OneRowLoop), over dense weights kept as well."""

    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    quantization: str = "none"
    batch_invariant: bool = False
    dense_in_graph: bool = False
    eager_one_row: bool = False


class Linear:
    """y = x W^T (+ b) in the model dtype, multiplied by `matmul` (kvserve/model/float_kernels.py): F.linear over W
    held as an nn.Parameter (the same tensor), which is what the compiled decode step's --compile-gemms freezes into
    its graph (compile/steps.py), or oneDNN's linear over its packed copy of W, which then replaces W
    (`weight` None) unless `keep_dense`: a compiled graph's one-row steps multiply W in loops of their own
    (one_row_in_graph), which beat oneDNN's call at one row, so --compile-decode keeps W beside the packed copy.
    Eager steps multiply one row by `one_row` (OneRowLoop, the same loop compiled on its own) where they have it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, matmul: FloatMatmul | None = None,
                 keep_dense: bool = False, one_row: OneRowLoop | None = None):
        self.matmul = matmul or BLAS
        self.bias = bias
        self.in_features, self.dtype = weight.shape[1], weight.dtype
        self.packed = self.matmul.pack(weight)
        self.weight = parameter(weight) if self.packed is None or keep_dense or one_row is not None else None
        self.one_row = one_row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.dtype in GRAPH_MATRIX_VECTOR_DTYPES and one_row_in_graph(x):
            # Inductor's own loop over every core (one_row_in_graph), products and sums in float32 (the casts are
            # fused into the loop: bfloat16 weights are read as they are), over the row in a buffer (in_buffer)
            y = one_row_product(in_buffer(x.float()), self.weight).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.one_row is not None and x.numel() == self.in_features and x.dtype == self.dtype:
            y = self.one_row(x.reshape(-1), self.weight)  # None: no graph takes it (then the route's call)
            if y is not None:
                y = y.view(*x.shape[:-1], y.shape[0])
                return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return self.matmul.linear(x, None, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    @property
    def dense_copy_nbytes(self) -> int:
        """Bytes of the dense weight kept beside a packed copy (keep_dense); 0 without one."""
        return self.weight.nbytes if self.packed is not None and self.weight is not None else 0

    def storages(self) -> dict[int, int]:
        return {**tensor_storages(self.weight, self.bias), **self.matmul.storages(self.packed)}


class Int8Linear:
    """int8 weights [N, K], rotated (W R), with float32 scales [N] (absmax per output channel / 127), run by
    `kernel`, which keeps the codes in its own form (`packed`); each call rotates its input by the same R."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: Int8Kernel | None = None,
                 keep_codes: bool = False):
        rotation = input_rotation(weight)
        self.__init_from_codes(*quantize_rows(rotation(weight.float())), rotation, bias, kernel or choose_kernel(),
                               keep_codes)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, rotation: KroneckerRotation,
                   kernel: Int8Kernel, keep_codes: bool = False) -> Int8Linear:
        """A linear over codes already quantized from W R (a tied table's)."""
        linear = cls.__new__(cls)
        linear.__init_from_codes(codes, scale, rotation, None, kernel, keep_codes)
        return linear

    def __init_from_codes(self, codes: torch.Tensor, scale: torch.Tensor, rotation: KroneckerRotation,
                          bias: torch.Tensor | None, kernel: Int8Kernel, keep_codes: bool) -> None:
        self.weight_scale = scale
        self.rotation = rotation
        self.bias = bias
        self.kernel = kernel
        self.in_features = codes.shape[1]
        self.packed = kernel.pack(codes)
        # the codes as they are, for a compiled graph's one-row loops (one_row_sums); a kernel that packs a copy of
        # its own (oneDNN) then leaves them held twice
        self.codes = parameter(codes) if keep_codes else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x_q, x_scale = quantize_rows(self.rotation(x.reshape(-1, x.shape[-1]).float()))
        if self.codes is not None and one_row_in_graph(x) and not torch._inductor.config.freezing:
            sums = one_row_sums(x_q, self.codes)  # the same exact sums (--compile-gemms: the kernel's template)
        else:
            sums = self.kernel.matmul(x_q, self.packed)  # [M, N] float32: the exact integer sums
        y = sums.mul_(x_scale[:, None]).mul_(self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, y.shape[-1])  # not -1: a call may have no rows (a prefill chunk that samples nothing)

    @property
    def codes_copy_nbytes(self) -> int:
        """Bytes of the codes kept beside a kernel's own copy of them (keep_codes); 0 without one."""
        return self.codes.nbytes if self.codes is not None and self.kernel.copies_codes else 0

    def storages(self) -> dict[int, int]:
        return {**tensor_storages(self.weight_scale, self.bias, self.codes), **self.kernel.storages(self.packed),
                **self.rotation.storages()}


class OneRowLoop:
    """One row times a float weight as the loop a compiled graph writes for its one-row steps (Linear.__call__), for
    steps that run eagerly while compiling is on (a model family no step graph takes, such as the Gated DeltaNet
    hybrids, or settings that need eager steps): products and sums in float32, vectorized and split over every core
    by Inductor, where oneDNN's call at one row reads the weights more slowly (docs/benchmarks.md, "A hybrid
    model"). One graph serves every weight shape of a dtype (its sizes dynamic), compiled or loaded at warm_up as
    the KV formats' kernels are (kv/formats/compiled.py: saved whole, nothing compiled while serving; a failure says
    why once and leaves the route's call)."""

    def __init__(self):
        self.compiled = CompiledFunction(one_row_product)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        with torch.inference_mode():  # the graph's row is an inference tensor: a row made outside (the runner picks
            row = x if x.is_inference() else x.clone()  # the head's rows so) is copied into one
            # detach: a plain tensor, not the nn.Parameter, whose sizes Dynamo would take as constants
            return self.compiled((row, weight.detach()))

    def warm_up(self, dtype: torch.dtype, device: str | torch.device) -> None:
        """Compile (or load) the graph for calls as __call__ makes them: the weight made outside inference mode, the
        row inside it."""
        with torch.inference_mode(False):  # as the weights are made, whoever warms it up
            weight = torch.zeros(48, 32, dtype=dtype, device=device)
        with torch.inference_mode(), self.compiled.warming_up():
            x = torch.zeros(32, dtype=dtype, device=device)
            self.compiled((x, weight), dynamic=[(x, 0), (weight, 0), (weight, 1)])

    @property
    def failed(self) -> str | None:
        return self.compiled.failed


def one_row_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One row x ([K], or [..., 1, K]) times weight [N, K] transposed, in x's dtype, as a product and a sum in float32:
    what a compiled graph's one-row step writes (Linear.__call__) and OneRowLoop's graph."""
    return (x.float().unsqueeze(-2) * weight.float()).sum(-1).to(x.dtype)


def one_row_sums(x_q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """sum_k x_q[0, k] codes[n, k] for one row of int8 codes, as float32 [1, N]: the integer kernels' numbers, as a
    product and a sum that Inductor compiles to a loop of its own over every core (one_row_in_graph), reading the
    codes once. Each slice of at most EXACT_FLOAT_COLUMNS columns sums exactly in float32 in whatever order the loop
    adds; the slices' integer sums are added as int32 and rounded to float32 once, as the integer kernels' are.
    Equal slices are a dimension of their own (equal_slices), so the loop reads each row of codes straight through;
    slices cut one after another make a loop each, each reading its piece of every row, which took longer over
    SmolLM2's down projection's codes (576 x 1536) on the AMD EPYC of family 25 (docs/benchmarks.md)."""
    x = in_buffer(x_q.float())  # the row's rotation and quantization done once, not for every output n
    n, k = codes.shape
    slices = equal_slices(k)
    if slices is not None:
        products = x.view(1, 1, slices, k // slices) * codes.view(1, n, slices, k // slices).float()
        return products.sum(-1).to(torch.int32).sum(-1).float()
    sums = None
    for start in range(0, k, EXACT_FLOAT_COLUMNS):
        part = (x[:, None, start : start + EXACT_FLOAT_COLUMNS]
                * codes[:, start : start + EXACT_FLOAT_COLUMNS].float()).sum(-1)
        sums = part.to(torch.int32) if sums is None else sums + part.to(torch.int32)
    return sums.float()


def equal_slices(columns: int, min_width: int = 64) -> int | None:
    """The fewest equal slices of `columns` that each sum exactly in float32 (at most EXACT_FLOAT_COLUMNS wide, at
    least `min_width`), or None where none divides them so."""
    fewest = -(-columns // EXACT_FLOAT_COLUMNS)
    for slices in range(fewest, columns // min_width + 1):
        if columns % slices == 0:
            return slices
    return None


def parameter(weight: torch.Tensor) -> torch.nn.Parameter:
    """A weight as a frozen nn.Parameter over the same storage (no copy, no gradient)."""
    return torch.nn.Parameter(weight, requires_grad=False)


def input_rotation(weight: torch.Tensor) -> KroneckerRotation:
    """The rotation of a weight's input channels, in float32 (the activations are rotated in float32)."""
    return kronecker_rotation(weight.shape[1], torch.float32, str(weight.device))


class Embedding:
    """Rows of the token embedding table; an int8 table (shared with a tied int8 lm_head, so stored rotated) is
    dequantized per row and rotated back."""

    def __init__(self, table: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 rotation: KroneckerRotation | None = None):
        self.table = table
        self.scale = scale
        self.dtype = dtype or table.dtype
        self.rotation = rotation

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.table)
        if self.scale is None:
            return rows
        rows = rows.float() * self.scale[input_ids, None]
        if self.rotation is not None:
            rows = self.rotation.invert(rows.reshape(-1, rows.shape[-1])).view(rows.shape)
        return rows.to(self.dtype)

    def storages(self) -> dict[int, int]:
        return {**tensor_storages(self.table, self.scale), **(self.rotation.storages() if self.rotation else {})}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: codes [M, K] and float32 scales [M] (a zero row gets a tiny scale and codes 0).

    Few ops on purpose (a decode step calls this 120 times): |x| / (amax / 127) <= 127 rounds to at most 127,
    so no clamp is needed. amax as abs then amax: the same numbers as torch.linalg.vector_norm(x, inf), whose
    CPU kernel is many times slower on rows in batches (it was 10% of int8's decode-heavy time, `--profile`)."""
    amax = x.abs().amax(dim=-1).float()
    scale = amax.clamp_(min=MIN_AMAX).div_(INT8_MAX)
    return x.float().div(scale[:, None]).round_().to(torch.int8), scale


class Linears:
    """Builds a model's linears and embedding as `policy` says.

    A tied int8 table is quantized once (rotated, as the head's input is); lookups read its codes and rotate them
    back, and the head multiplies by them, through a view
    or, when the kernel keeps a packed copy of its own (oneDNN), through that copy: then the table is held twice
    (`tied_copy_nbytes`). So is a tied float table that oneDNN's linear multiplies (float_kernels.py): lookups read
    the table, the head its packed copy. Float weights are multiplied by `matmul`, by default the probe's choice
    (choose_matmul); for_policy gives the BLAS call under batch_invariant and off the CPU. With the policy's
    dense_in_graph, float weights that a packed route multiplies keep their dense form too (`dense_copy_nbytes`)."""

    def __init__(self, policy: WeightsPolicy, kernel: Int8Kernel | None = None, matmul: FloatMatmul | None = None,
                 shapes: WeightShapes = FIXED):
        self.policy = policy
        self.shapes = shapes  # what the routes were probed on
        self.kernel = (kernel or choose_kernel(shapes)) if policy.quantization == "int8" else None
        self.matmul = matmul or (BLAS if self.kernel is not None else choose_matmul(policy.dtype, shapes))
        # dense copies only of what a one-row loop reads: float weights of GRAPH_MATRIX_VECTOR_DTYPES (float16's stay
        # oneDNN's alone)
        self.dense_in_graph = (policy.dense_in_graph and self.kernel is None and
                               policy.dtype in GRAPH_MATRIX_VECTOR_DTYPES)
        # eager steps' one-row loop (OneRowLoop), over dense float weights as well
        self.one_row = (OneRowLoop() if policy.eager_one_row and self.kernel is None and
                        policy.dtype in GRAPH_MATRIX_VECTOR_DTYPES else None)
        # ... and int8 codes as they are, beside the packed form of a kernel that a graph's one-row loop replaces
        # (Int8Linear's keep_codes; the kernel's loops_at_one_row)
        self.keep_codes = policy.dense_in_graph and self.kernel is not None and self.kernel.loops_at_one_row
        self.tied_copy_nbytes = 0
        self.dense_copy_nbytes = 0

    @classmethod
    def for_policy(cls, policy: WeightsPolicy, shapes: WeightShapes = FIXED) -> Linears:
        """The routes `policy` allows, probed on the model's `shapes`: oneDNN's linears and the int8 kernels' probe
        are CPU routes, and the BLAS call is the batch-invariant one."""
        cpu = torch.device(policy.device).type == "cpu"
        int8_off_cpu = policy.quantization == "int8" and not cpu
        kernel = FloatKernel("the int8 kernels are probed on a CPU only") if int8_off_cpu else None
        return cls(policy, kernel, matmul=BLAS if policy.batch_invariant or not cpu else None, shapes=shapes)

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear | Int8Linear:
        if self.kernel is None:
            linear = Linear(weight, bias, self.matmul, keep_dense=self.dense_in_graph, one_row=self.one_row)
            self.dense_copy_nbytes += linear.dense_copy_nbytes
            return linear
        linear = Int8Linear(weight, bias, self.kernel, keep_codes=self.keep_codes)
        self.dense_copy_nbytes += linear.codes_copy_nbytes
        return linear

    @property
    def one_row_loops(self) -> bool:
        """Whether a compiled graph's one-row steps multiply these weights (float, or int8 codes) in loops of its
        own (Linear, Int8Linear)."""
        return self.dense_in_graph or self.keep_codes or (
            self.kernel is None and self.policy.dtype in GRAPH_MATRIX_VECTOR_DTYPES and self.matmul is BLAS)

    def head_and_embedding(self, embed: torch.Tensor, lm_head: torch.Tensor | None) -> tuple[Linear | Int8Linear,
                                                                                            Embedding]:
        """The output projection and the input embedding; `lm_head` None means tied to `embed` (one table kept)."""
        if self.kernel is None:
            head = self.linear(lm_head if lm_head is not None else embed)
            if lm_head is None and head.packed is not None:
                self.tied_copy_nbytes = sum(self.matmul.storages(head.packed).values())
                self.dense_copy_nbytes -= head.dense_copy_nbytes  # the table itself, which the lookups keep anyway
            return head, Embedding(embed)
        rotation = input_rotation(embed)
        codes, scale = quantize_rows(rotation(embed.float()))
        embedding = Embedding(codes, scale, self.policy.dtype, rotation)
        if lm_head is None:  # tied: the head multiplies by the table's own (rotated) codes
            head = Int8Linear.from_codes(codes, scale, rotation, self.kernel, self.keep_codes)  # the lookups' codes
            self.tied_copy_nbytes = sum(self.kernel.storages(head.packed).values()) if self.kernel.copies_codes else 0
            return head, embedding
        return self.linear(lm_head), embedding


def load_linears(weights: dict[str, torch.Tensor], tied: bool,
                 policy: WeightsPolicy) -> tuple[dict[str, torch.Tensor], Linears, Linear | Int8Linear, Embedding]:
    """A decoder's weights in the policy's dtype on its device (the tables taken out), its Linears, output head and
    embedding."""
    w = {name: _own(t.to(dtype=policy.dtype, device=policy.device)) for name, t in weights.items()}
    linears = Linears.for_policy(policy, WeightShapes.of_weights(w, tied))
    lm_head, embed = linears.head_and_embedding(w.pop("model.embed_tokens.weight"),
                                                None if tied else w.pop("lm_head.weight"))
    return w, linears, lm_head, embed


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A one-dimensional view (a norm's weight or a bias, sliced from a loaded file's buffer) as a tensor of its own:
    the layers hold these as they are, and a compiled graph wraps a view's base too, for every layer its one traced
    layer is reused for. Matrices are never held as loaded (packed, quantized or made parameters)."""
    return tensor.clone() if tensor.dim() == 1 and tensor._base is not None else tensor


def tensor_storages(*tensors: torch.Tensor | None) -> dict[int, int]:
    """{storage address: bytes} of the tensors given (None skipped): views of one storage count once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


def weights_nbytes(*holders) -> int:
    """Bytes of the distinct storages held by `holders` (objects with storages(), or tensors); tied weights
    count once."""
    seen: dict[int, int] = {}
    for holder in holders:
        seen.update(holder.storages() if hasattr(holder, "storages") else tensor_storages(holder))
    return sum(seen.values())


def one_row_in_graph(x: torch.Tensor) -> bool:
    """Whether `x` is one row (token) of a graph that torch.compile is tracing, its size fixed there (not a symbol).

    There a matrix-vector product (GRAPH_MATRIX_VECTOR_DTYPES) is written as a product and a sum, which Inductor
    compiles to a loop of its own, vectorized and split over every core, accumulating in float32: the BLAS call at
    one row (MKL's sgemv on the AMD EPYCs) keeps to one core and reads the weights at about half the memory bandwidth
    that the two cores reach (docs/benchmarks.md, "One row's matrix-vector product as the graph's own loop"). Its sums
    are added in another order than the BLAS's, a few float32 ulps apart."""
    if not torch.compiler.is_compiling():
        return False
    lead = x.shape[:-1]
    return all(type(size) is int for size in lead) and math.prod(lead) == 1
