"""The start-up probe picks an int8 route only when it beats float32, and otherwise falls back, saying so."""
import torch

from kvserve.model import int8_kernels
from kvserve.model.int8_kernels import FloatKernel, Int8Kernel, KernelChoice, probe_kernels


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
    choice = probe_kernels((Broken(), Slow()))
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
