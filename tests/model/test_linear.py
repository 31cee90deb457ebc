"""int8 linears (W8A8, per-output-channel weight scales, per-token activation scales) against a float reference:
within the worst-case rounding bound, about 1% on Gaussian data, each row independent of its batch, and the same
numbers through every kernel route."""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kvserve.batch_invariant import TILE_ROWS, RowTiles
from kvserve.model.int8_kernels import KERNELS, FloatKernel, IntMMKernel
from kvserve.model import float_kernels, int8_kernels, linear, probe_shapes
from kvserve.model.float_kernels import BLAS, OneDNNMatmul
from kvserve.model.probe_shapes import WeightShapes
from kvserve.model.linear import (Embedding, Int8Linear, Linear, Linears, WeightsPolicy, quantize_rows,
                                  weights_nbytes)

AVAILABLE = [k for k in KERNELS if k.available()] + [FloatKernel()]


def gaussian(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_quantize_rows_round_trip_within_half_a_step():
    x = gaussian(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.0])[:, None]  # a zero row too
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.all((codes.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * (1 + 1e-6))
    assert torch.equal(codes[4], torch.zeros(64, dtype=torch.int8))


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
def test_int8_linear_is_within_the_rounding_bound_of_float(kernel):
    x, w, bias = gaussian(7, 96, seed=1) * 3, gaussian(40, 96, seed=2), gaussian(40, seed=3)
    linear = Int8Linear(w, bias, kernel)
    y = linear(x)
    reference = x @ w.T + bias
    # both sides are rotated (x R)(W R)^T = x W^T, then quantized per row:
    # |x w - x~ w~| <= sum_k |x_k| dw + |w_k| dx + dx dw, with x, w rotated and dx, dw half a step of each row
    x, w = linear.rotation(x), linear.rotation(w)
    dx = quantize_rows(x)[1][:, None] / 2
    dw = quantize_rows(w)[1][None, :] / 2
    bound = x.abs().sum(1, keepdim=True) * dw + dx * w.abs().sum(1)[None, :] + 96 * dx * dw
    assert torch.all((y - reference).abs() <= bound * (1 + 1e-4))
    # typical error on Gaussian data: about 1% of the output's size
    assert (y - reference).norm() / reference.norm() < 0.02


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
def test_no_rows_give_no_rows(kernel):
    # a prefill chunk that completes no prompt samples nothing: the output head gets zero rows (it raised, so an int8
    # model failed every prompt longer than a step's token budget)
    linear = Int8Linear(gaussian(40, 96, seed=2), gaussian(40, seed=3), kernel)
    assert linear(torch.empty(0, 96)).shape == (0, 40)
    assert linear(torch.empty(2, 0, 96)).shape == (2, 0, 40)


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
def test_each_row_is_the_same_alone_or_batched_in_fixed_tiles(kernel):
    linear, tiles = Int8Linear(gaussian(64, 128, seed=4), kernel=kernel), RowTiles(TILE_ROWS)
    batch = gaussian(33, 128, seed=5) * torch.linspace(0.01, 100, 33)[:, None]  # neighbours of every size
    together = tiles.map(linear, batch)
    for i in (0, 16, 32):
        assert torch.equal(tiles.map(linear, batch[i : i + 1]), together[i : i + 1])


def test_every_kernel_route_gives_the_same_numbers():
    w, x = gaussian(48, 256, seed=6), gaussian(9, 256, seed=7)
    outputs = [Int8Linear(w, kernel=k)(x) for k in AVAILABLE]
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_int8_keeps_the_activation_dtype():
    x = gaussian(3, 32).bfloat16()
    assert Int8Linear(gaussian(16, 32), kernel=FloatKernel())(x).dtype == torch.bfloat16


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
def test_tied_int8_embedding_reads_the_head_codes(kernel):
    table = gaussian(50, 16, seed=8)
    head, embedding = Linears(WeightsPolicy(quantization="int8"), kernel).head_and_embedding(table, None)
    ids = torch.tensor([0, 7, 49])
    codes, scale = quantize_rows(head.rotation(table))  # the head's codes: the table rotated, as its input is
    assert torch.equal(embedding(ids), head.rotation.invert(codes[ids].float() * scale[ids, None]))
    # rotating back keeps each row's error norm: at most half a step per channel
    assert torch.all((embedding(ids) - table[ids]).norm(dim=1) <= scale[ids] / 2 * 16**0.5 * (1 + 1e-5))
    assert torch.equal(head(table[:3]), Int8Linear(table, kernel=kernel)(table[:3]))
    if isinstance(kernel, IntMMKernel):  # its packed form is a view of the codes: one table for both
        assert weights_nbytes(head, embedding) == weights_nbytes(embedding)


def test_float_linears_are_plain_and_tied_tables_count_once():
    table = gaussian(50, 16)
    head, embedding = Linears(WeightsPolicy(), matmul=BLAS).head_and_embedding(table, None)
    assert isinstance(head, Linear) and isinstance(embedding, Embedding)
    assert torch.equal(head(table[:2]), table[:2] @ table.T)
    assert weights_nbytes(head, embedding) == table.nbytes


@pytest.mark.skipif(not OneDNNMatmul().available(torch.float32), reason="no oneDNN in this torch build")
def test_onednn_float_linears_replace_the_weight_and_a_tied_table_is_held_twice():
    """oneDNN's linear multiplies a packed copy of the weight, which replaces the dense one (the same bytes); a tied
    table stays for lookups beside the head's packed copy, counted as tied_copy_nbytes. Results are F.linear's up to
    float32 rounding, for any number of rows, none included."""
    table, weight, bias = gaussian(50, 16), gaussian(24, 16, seed=1), gaussian(24, seed=2)
    linears = Linears(WeightsPolicy(), matmul=OneDNNMatmul())
    head, embedding = linears.head_and_embedding(table, None)
    layer = linears.linear(weight, bias)
    assert head.weight is None and layer.weight is None and head.packed is not None
    assert linears.tied_copy_nbytes == table.nbytes
    assert weights_nbytes(head, embedding) == 2 * table.nbytes
    assert weights_nbytes(layer) == weight.nbytes + bias.nbytes
    for rows in (0, 1, 3, 40):
        x = gaussian(rows, 16, seed=rows)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head(x), x @ table.T, rtol=1e-5, atol=1e-5)
    assert layer(gaussian(2, 3, 16)).shape == (2, 3, 24)


def test_the_float_matmul_probe_picks_a_route_only_where_it_wins_at_every_size(monkeypatch):
    """A route wins only if it beats F.linear at one token and at 64 (it is not timed at 64 once it lost at one);
    otherwise the BLAS call stays and the line says nothing beat it. The timings are fakes, in the probe's order
    (F.linear, then the route, at each size): which route wins is the probe's rule, not this CPU's."""
    shapes = WeightShapes(((8, 4, 1),))
    route = OneDNNMatmul()
    monkeypatch.setattr(route, "available", lambda dtype: True)
    monkeypatch.setattr(route, "pack", lambda weight: weight)
    for route_times, wins, timed in (([0.5, 0.5], True, 4), ([0.5, 2.0], False, 4), ([2.0, 0.5], False, 2)):
        times = iter([1.0, route_times[0], 1.0, route_times[1]])
        calls = []
        monkeypatch.setattr(probe_shapes, "best_time", lambda fn, reps=5: calls.append(fn) or next(times))
        choice = float_kernels.probe_matmuls(torch.float32, (route,), shapes)
        assert (choice.matmul is route) == wins and len(calls) == timed, route_times
        kept = "float32 matmuls: F.linear, PyTorch's BLAS call (MKL on x86) (nothing else beat it here; probed now)"
        assert ("probed now: 2.0x F.linear at 1 token, 2.0x F.linear at 64 tokens" in choice.describe()) if wins \
            else choice.describe() == kept


@pytest.mark.parametrize("kernel", AVAILABLE, ids=lambda k: k.name)
def test_an_outlier_channel_costs_little_once_rotated(kernel):
    """Activations with a channel 100x the others: quantized as they are, the other channels keep about one level
    of 127 and their share of the output is lost to a quarter; rotated first, the outlier is spread over every
    channel and the error is a fifth of that."""
    x, w = gaussian(16, 256, seed=9), gaussian(64, 256, seed=10)
    x[:, 3] *= 100
    reference = x @ w.T
    rest = x.clone()
    rest[:, 3] = 0
    rest = rest @ w.T  # what the ordinary channels contribute
    rotated = Int8Linear(w, kernel=kernel)(x)
    codes, scale = quantize_rows(x)
    w_codes, w_scale = quantize_rows(w)
    unrotated = (codes.float() * scale[:, None]) @ (w_codes.float() * w_scale[:, None]).T
    error = lambda y: ((y - reference).norm() / rest.norm()).item()  # noqa: E731
    assert error(rotated) < 0.08 and error(unrotated) > 0.2


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_one_row_in_a_graph_is_a_product_and_a_sum_within_float_rounding(dtype, tolerance):
    """In a graph torch.compile traces, a float linear over one row (its size fixed) is written as a product and a
    sum (Inductor's loop over every core, not a one-core BLAS call); over rows whose number is a symbol, and eagerly,
    it stays F.linear. Either way the result is the matmul's up to rounding: float32 sums in another order (and for
    bfloat16, each output rounded to it)."""
    torch.manual_seed(0)
    layer = Linear(torch.randn(48, 96).to(dtype), torch.randn(48).to(dtype))
    seen = []

    def call(x):
        seen.append(linear.one_row_in_graph(x))
        return layer(x)

    compiled = torch.compile(call, dynamic=False, fullgraph=True)
    one, rows = torch.randn(1, 96).to(dtype), torch.randn(5, 96).to(dtype)
    assert not linear.one_row_in_graph(one)  # eagerly
    torch.testing.assert_close(compiled(one), layer(one), rtol=tolerance, atol=tolerance)
    torch._dynamo.mark_dynamic(rows, 0)
    torch.testing.assert_close(compiled(rows), layer(rows), rtol=tolerance, atol=tolerance)
    assert seen == [True, False]  # traced once per graph: one row, then a symbolic number of rows
    assert not linear.one_row_in_graph(one)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_tensors_a_layer_holds_are_no_views(tmp_path, quantization):
    """A compiled graph's one traced layer is reused for every layer with that layer's tensors, and Dynamo wraps a
    view's base too: the norms sliced from a loaded file's buffer are tensors of their own, and torch._int_mm's W^T
    a tensor of its own over the codes' storage (no copy: the weights' bytes stay the codes')."""
    from kvserve.engine.llm import LLM
    from tests.conftest import make_tiny_model

    path = make_tiny_model(tmp_path, attention_bias=True)
    with mock.patch.object(linear, "choose_kernel", lambda shapes: IntMMKernel()), \
            mock.patch.object(linear, "choose_matmul", lambda dtype, shapes: BLAS):
        model = LLM(str(path), kv_cache_memory="2MiB", max_model_len=256, quantization=quantization,
                    enforce_eager=True).engine.model
    tensors = []
    for layer in model.layers:
        for part in layer.weight_parts():
            tensors += [t for t in vars(part).values() if isinstance(t, torch.Tensor)] if not \
                isinstance(part, torch.Tensor) else [part]
    assert tensors and all(t._base is None for t in tensors)
    if quantization == "int8":
        qkv = model.layers[0].qkv
        assert qkv.packed.stride() == (1, qkv.packed.shape[0])  # W^T over [N, K] codes, as their .t() was
        assert weights_nbytes(qkv.packed) == qkv.packed.numel()


def test_dense_copies_only_of_what_a_one_row_loop_reads():
    """A policy with dense_in_graph keeps a packed route's float32 and bfloat16 weights dense too (the compiled
    one-row loops read them), not float16's, which no loop reads, nor int8 weights (whose kernel has its own)."""
    class Packing:  # a packed route, whatever the CPU (oneDNN's own availability differs by dtype and CPU)
        name = "packing"

        def pack(self, weight):
            return weight.clone()

        def storages(self, packed):
            return {packed.untyped_storage().data_ptr(): packed.nbytes}

    kept = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        linears = Linears(WeightsPolicy(dtype, dense_in_graph=True), matmul=Packing())
        layer = linears.linear(torch.randn(8, 16).to(dtype))
        kept[dtype] = (layer.weight is not None, linears.dense_copy_nbytes, linears.one_row_loops)
    assert kept == {torch.float32: (True, 8 * 16 * 4, True), torch.bfloat16: (True, 8 * 16 * 2, True),
                    torch.float16: (False, 0, False)}
    int8 = Linears(WeightsPolicy(quantization="int8", dense_in_graph=True), kernel=FloatKernel())
    assert not int8.dense_in_graph and not int8.one_row_loops


class CopyingKernel(IntMMKernel):
    """torch._int_mm over a copy of the codes of its own, as oneDNN's packed form is, replaced at one row in a graph
    by the loop, as oneDNN's is."""

    copies_codes = True
    loops_at_one_row = True

    def pack(self, weight):
        return super().pack(weight.clone())


@pytest.mark.parametrize("kernel, copied", [(IntMMKernel(), 0), (CopyingKernel(), 8 * 16)],
                         ids=["a view of the codes", "a copy of its own"])
def test_int8_codes_are_kept_as_they_are_for_the_one_row_loops(kernel, copied):
    """With dense_in_graph, the linears of a kernel that a graph's one-row loop replaces (loops_at_one_row) keep their
    codes as they are (Int8Linear.codes): held twice where the kernel packs a copy of its own (counted in
    dense_copy_nbytes and the weights' bytes), once where its packed form is a view of them. The tied head reads the
    lookups' own codes."""
    linears = Linears(WeightsPolicy(quantization="int8", dense_in_graph=True), kernel=kernel)
    layer = linears.linear(torch.randn(8, 16))
    assert layer.codes is not None and linears.one_row_loops and linears.dense_copy_nbytes == copied
    assert weights_nbytes(layer) == 8 * 16 + copied + weights_nbytes(layer.weight_scale, layer.rotation)
    head, embedding = linears.head_and_embedding(torch.randn(50, 16), None)
    assert head.codes.untyped_storage().data_ptr() == embedding.table.untyped_storage().data_ptr()
    assert linears.dense_copy_nbytes == copied  # the table's codes are the lookups' anyway
    eager = Linears(WeightsPolicy(quantization="int8"), kernel=kernel)
    assert eager.linear(torch.randn(8, 16)).codes is None and not eager.one_row_loops


def test_the_kernels_a_one_row_loop_replaces():
    """Every integer kernel's call at one row in a graph is replaced by the loop (slower than it: oneDNN's on the Intel
    Xeon, torch._int_mm's on the AMD EPYC of family 25: docs/benchmarks.md); the float32 fallback's codes are float
    weights (no integer loop), which keep no codes beside them."""
    assert [k.loops_at_one_row for k in KERNELS] == [True, True, True]
    assert [type(k).__name__ for k in KERNELS] == ["IntMMKernel", "OneDNNKernel", "FbgemmKernel"]
    assert not FloatKernel().loops_at_one_row
    linears = Linears(WeightsPolicy(quantization="int8", dense_in_graph=True), kernel=FloatKernel())
    assert not linears.keep_codes and linears.linear(torch.randn(8, 16)).codes is None


@pytest.mark.parametrize("columns", [576, 1536, 3000, 2083], ids=lambda k: f"{k} columns")
def test_one_rows_int8_sums_are_the_integer_sums_in_a_graph_and_out(columns):
    """one_row_sums, eagerly and as Inductor's loop: bitwise the integer sums that every int8 kernel returns, over
    one, two and three equal slices of at most EXACT_FLOAT_COLUMNS, and over slices cut one after another where no
    equal ones fit (2083 columns, a prime), with rows of the largest codes (sums past 2^24 rounded once to float32, as
    the kernels' int32 sums are; one float32 sum of all the products rounds on the way and misses)."""
    gen = torch.Generator().manual_seed(columns)
    codes = torch.randint(100, 128, (40, columns), dtype=torch.int8, generator=gen)  # sums of like sign: large
    codes[0], codes[1] = 127, -127
    codes[2:20] = -codes[2:20]
    x = torch.randint(100, 128, (1, columns), dtype=torch.int8, generator=gen)
    reference = (x.long() @ codes.long().t()).float()
    assert reference.abs().min() > 2**24 or columns < int8_kernels.EXACT_FLOAT_COLUMNS
    assert torch.equal(linear.one_row_sums(x, codes), reference)
    assert torch.equal(torch.compile(linear.one_row_sums, dynamic=False, fullgraph=True)(x, codes), reference)


def test_equal_slices_are_the_fewest_that_sum_exactly_and_divide_the_columns():
    assert [linear.equal_slices(k) for k in (576, 1040, 1041, 1536, 3000, 4096)] == [1, 1, 3, 2, 3, 4]
    assert linear.equal_slices(2083) is None  # a prime: no slices of 64 to 1,040 columns
    assert linear.equal_slices(64 * 1024) == 64
    for k in (1041, 1536, 3000, 4096, 5000):
        width = k // linear.equal_slices(k)
        assert width * linear.equal_slices(k) == k and 64 <= width <= int8_kernels.EXACT_FLOAT_COLUMNS


def test_an_int8_linear_keeping_its_codes_multiplies_one_row_in_a_graph_by_its_own_loop(monkeypatch):
    """In a graph torch.compile traces, an int8 linear over one row (its size fixed) that keeps its codes sums them by
    one_row_sums; over rows whose number is a symbol, and eagerly, by its kernel. The sums are the same integers, so
    only the rotation and the per-row quantization (Inductor's float32 loops) differ from eager's, by rounding."""
    seen = []
    sums = linear.one_row_sums
    monkeypatch.setattr(linear, "one_row_sums", lambda x, codes: seen.append("loops") or sums(x, codes))

    class Counting(FloatKernel):  # exact integer sums on every CPU
        def matmul(self, x, packed):
            seen.append("kernel")
            return super().matmul(x, packed)

    layer = Int8Linear(gaussian(48, 96, seed=1), gaussian(48, seed=2), Counting(), keep_codes=True)
    compiled = torch.compile(lambda x: layer(x), dynamic=False, fullgraph=True)
    one, rows = gaussian(1, 96, seed=3), gaussian(5, 96, seed=4)
    torch.testing.assert_close(compiled(one), layer(one), rtol=1e-3, atol=1e-3)
    assert seen == ["loops", "kernel"]  # the graph's one row, then eager's
    seen.clear()
    torch._dynamo.mark_dynamic(rows, 0)
    torch.testing.assert_close(compiled(rows), layer(rows), rtol=1e-3, atol=1e-3)
    assert seen == ["kernel", "kernel"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_policy_picks_the_routes_once(device):
    """The BLAS call under batch_invariant and off the CPU, the float32 kernel for int8 off the CPU (the int8 kernels
    are probed on a CPU only), the probes' choices otherwise (nothing is placed on `device` here)."""
    blas = Linears.for_policy(WeightsPolicy(device=device, batch_invariant=True))
    assert blas.matmul is BLAS and blas.kernel is None
    int8 = Linears.for_policy(WeightsPolicy(device=device, quantization="int8"))
    assert int8.matmul is BLAS and isinstance(int8.kernel, FloatKernel) == (device != "cpu")
    probed = Linears.for_policy(WeightsPolicy(device=device))
    assert probed.matmul is (float_kernels.choose_matmul(torch.float32) if device == "cpu" else BLAS)


class CountingRoute:
    """A packed route (whatever the CPU) that counts its calls."""

    name = "counting"

    def __init__(self):
        self.calls = 0

    def pack(self, weight):
        return weight.clone()

    def linear(self, x, weight, packed, bias):
        self.calls += 1
        return F.linear(x, packed, bias)

    def storages(self, packed):
        return {packed.untyped_storage().data_ptr(): packed.nbytes}


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_eager_steps_multiply_one_row_by_the_loop_compiled_once_for_every_shape(dtype, tolerance):
    """With eager_one_row a packed route's weights are kept dense too, and one row (whatever its leading shape) is
    multiplied by OneRowLoop's graph, the same product and sum a compiled step writes, compiled once at warm-up
    for every weight shape of the dtype (a row made outside inference mode, as the runner makes the head's, copied
    into one); several rows keep the route's call, and so does one row before the warm-up (nothing compiles outside
    it)."""
    torch.manual_seed(0)
    route = CountingRoute()
    linears = Linears(WeightsPolicy(dtype, eager_one_row=True), matmul=route)
    shapes = [(48, 96), (20, 32)]
    layers = [linears.linear(torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)) for n, k in shapes]
    assert linears.dense_copy_nbytes == sum(n * k for n, k in shapes) * torch.empty((), dtype=dtype).element_size()
    with torch.inference_mode():
        one = torch.randn(1, 96).to(dtype)
        assert torch.equal(layers[0](one), F.linear(one, layers[0].packed, layers[0].bias))  # not warmed up: the route
        assert route.calls == 1
        linears.one_row.warm_up(dtype, "cpu")
        assert linears.one_row.failed is None  # its graph compiled here, or one this process compiled before
        loop = linears.one_row.compiled
        warmed = (loop.graphs_compiled, loop.graphs_loaded)
        for layer, (n, k) in zip(layers, shapes):
            for lead in [(), (1,), (1, 1)]:
                x = torch.randn(*lead, k).to(dtype)
                expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype)
                torch.testing.assert_close(layer(x), expected, rtol=tolerance, atol=tolerance)
        assert route.calls == 1  # both shapes took the graph, and nothing compiled or loaded after the warm-up
        assert (loop.graphs_compiled, loop.graphs_loaded) == warmed
        with torch.inference_mode(False):
            outside = torch.randn(1, 32).to(dtype)
        assert not outside.is_inference()
        expected = F.linear(outside.float(), layers[1].weight.float(), layers[1].bias.float()).to(dtype)
        torch.testing.assert_close(layers[1](outside), expected, rtol=tolerance, atol=tolerance)
        assert route.calls == 1
        rows = torch.randn(3, 96).to(dtype)
        assert torch.equal(layers[0](rows), F.linear(rows, layers[0].packed, layers[0].bias)) and route.calls == 2
    plain = Linears(WeightsPolicy(dtype), matmul=CountingRoute())
    assert plain.one_row is None and plain.linear(torch.randn(4, 8).to(dtype)).weight is None
    assert Linears(WeightsPolicy(quantization="int8", eager_one_row=True), kernel=FloatKernel()).one_row is None
