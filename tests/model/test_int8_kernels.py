"""The start-up probe picks an int8 route only when it beats float32, and otherwise falls back, saying so."""
import gc

import pytest
import torch

from kvserve.engine.llm import LLM
from kvserve.model import int8_kernels, linear
from kvserve.model.int8_kernels import FloatKernel, Int8Kernel, KernelChoice, probe_kernels
from kvserve.model.probe_shapes import WeightShapes
from kvserve.sampling_params import SamplingParams
from tests.compile.test_steps import COMMON, INT8_LOGPROB_TOLERANCE, PROMPTS, compare
from tests.conftest import make_tiny_model


class Broken(Int8Kernel):
    name = "broken"

    def pack(self, weight):
        raise RuntimeError("no such kernel on this CPU")


class Slow(Int8Kernel):
    """Right answers, always far slower than float32."""

    name = "slow"

    def pack(self, weight):
        return weight.t()

    def matmul(self, x, packed):
        for _ in range(50):
            out = x.double() @ packed.double()
        return out.float()


def test_unavailable_and_slow_kernels_fall_back_to_float32_with_a_reason():
    assert not Broken().available()
    choice = probe_kernels((Broken(), Slow()), WeightShapes(((256, 128, 1),)))
    assert isinstance(choice.kernel, FloatKernel)
    assert "fallback: no int8 kernel beat float32" in choice.describe()


def test_the_described_choice_names_kernel_and_speedups():
    kernel = int8_kernels.KERNELS[0]
    text = KernelChoice(kernel, {1: 3.0, 64: 1.5}).describe()
    assert kernel.name in text and "3.0x float32 at 1 token" in text and "1.5x float32 at 64 tokens" in text


def test_the_fallback_multiplies_the_codes_exactly():
    w = torch.randint(-127, 128, (8, 32), dtype=torch.int8)
    x = torch.randint(-127, 128, (3, 32), dtype=torch.int8)
    kernel = FloatKernel()
    assert torch.equal(kernel.matmul(x, kernel.pack(w)), (x.long() @ w.long().T).float())


class Saturating(Int8Kernel):
    """oneDNN's way on a CPU without VNNI: activations shifted to uint8 (+128), pairs of products added in int16
    with saturation, the shift's share subtracted after."""

    name = "saturating"

    def pack(self, weight):
        return weight.t()

    def matmul(self, x, packed):
        products = (x.long() + 128)[:, :, None] * packed.long()[None]  # [M, K, N]
        pairs = (products[:, 0::2] + products[:, 1::2]).clamp(-32768, 32767)
        return (pairs.sum(1) - 128 * packed.long().sum(0)).float()


def test_a_kernel_that_saturates_is_not_used():
    assert not Saturating().available()
    assert Slow().available()


def test_the_fallback_is_exact_for_full_range_codes_and_independent_of_the_batch():
    kernel = FloatKernel()
    full = torch.full((4, int8_kernels.EXACT_FLOAT_COLUMNS), 127, dtype=torch.int8)
    assert torch.equal(kernel.matmul(full[:2], kernel.pack(full)), (full[:2].long() @ full.long().T).float())
    # past 2^24 a float32 sum rounds, but each slice of columns is exact and the slices add in one order
    w = torch.randint(-127, 128, (16, 3000), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    x = torch.randint(-127, 128, (33, 3000), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    packed = kernel.pack(w)
    together = kernel.matmul(x, packed)
    assert all(torch.equal(kernel.matmul(x[i : i + 1], packed), together[i : i + 1]) for i in range(33))
    assert torch.allclose(together, (x.long() @ w.long().T).float(), rtol=1e-6)


def test_a_kernel_slower_than_float32_at_one_token_is_not_timed_at_more_tokens():
    """A kernel that loses at one token cannot win (a winner beats float32 at every size probed): the probe never
    times it at 64 tokens (oneDNN's int8 linear on the AVX-512 AMD EPYC, far slower than float32 there, was most of
    an int8 start)."""
    calls = []

    class Counted(Slow):
        def matmul(self, x, packed):
            calls.append(x.shape[0])
            return super().matmul(x, packed)

    choice = probe_kernels((Counted(),), WeightShapes(((64, 32, 2),)))
    assert isinstance(choice.kernel, FloatKernel)
    # available()'s check (2 rows), then at 1 token the untimed first call and five timed ones, each over both
    # weights of the shape; none at 64
    assert calls == [2] + [1] * 12


FBGEMM = int8_kernels.FbgemmKernel()
needs_fbgemm = pytest.mark.skipif(not FBGEMM.available(), reason="FBGEMM's exact u8s8 linear is x86 with VNNI only")


@needs_fbgemm
def test_fbgemm_returns_the_exact_sums_bitwise_as_the_other_kernels_do():
    """Full-range codes, K past 1040 (sums beyond 2^24 round to float32 as the int32 sums of the others do)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randint(-127, 128, (96, 1536), dtype=torch.int8, generator=gen)
    w[0], w[1] = 127, -127
    others = [kernel for kernel in (*int8_kernels.KERNELS, FloatKernel()) if kernel.available()]
    for rows in (1, 2, 33):
        x = torch.randint(-127, 128, (rows, 1536), dtype=torch.int8, generator=gen)
        x[0] = 127
        sums = FBGEMM.matmul(x, FBGEMM.pack(w))
        assert torch.equal(sums, (x.long() @ w.long().T).float())
        assert all(torch.equal(sums, kernel.matmul(x, kernel.pack(w))) for kernel in others)


@needs_fbgemm
def test_fbgemm_in_a_compiled_graph_gives_the_eager_sums():
    w = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    x = torch.randint(-127, 128, (1, 64), dtype=torch.int8)
    handle = FBGEMM.pack(w)
    compiled = torch.compile(lambda x: FBGEMM.matmul(x, handle) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), (x.long() @ w.long().T).float() * 2)


@needs_fbgemm
def test_fbgemm_weights_live_as_long_as_their_handle():
    handle = FBGEMM.pack(torch.ones(8, 16, dtype=torch.int8))
    number = int(handle[0])
    assert number in int8_kernels._FBGEMM_WEIGHTS and FBGEMM.storages(handle) != {}
    del handle
    gc.collect()
    assert number not in int8_kernels._FBGEMM_WEIGHTS


@needs_fbgemm
def test_a_saved_graph_multiplies_by_the_fbgemm_weights_of_the_engine_that_loads_it(tmp_path, monkeypatch):
    """A graph holds FBGEMM handles as its inputs, not their numbers: another model of the same sizes loads the
    saved graph and runs its own weights, after the engine that saved it and its packed weights are gone."""
    monkeypatch.setattr(linear, "choose_kernel", lambda shapes=None: FBGEMM)
    first = LLM(str(make_tiny_model(tmp_path / "a")), **COMMON, quantization="int8", compile_decode=True)
    assert first.engine.runner.compiled.graphs_compiled > 0
    del first
    gc.collect()
    other = make_tiny_model(tmp_path / "b", seed=1)
    loaded = LLM(str(other), **COMMON, quantization="int8", compile_decode=True)
    assert loaded.engine.runner.compiled.graphs_compiled == 0 and loaded.engine.runner.compiled.graphs_loaded > 0
    eager = LLM(str(other), **COMMON, quantization="int8", enforce_eager=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, loaded, PROMPTS[:2], params, tolerance=INT8_LOGPROB_TOLERANCE)
