"""in_buffer is the tensor itself, eager and compiled, whatever its view (strides, storage offset), so holding a
result in a buffer never changes the numbers."""
import torch

from kvserve.graph_buffers import in_buffer


def test_in_buffer_is_the_tensor_itself_for_any_view():
    base = torch.arange(60, dtype=torch.float32).view(3, 4, 5)
    for view in (base, base.transpose(0, 2), base[1:, ::2, 1:], base[2]):
        held = in_buffer(view)
        assert torch.equal(held, view) and held.stride() == view.stride()
        assert held.data_ptr() == view.data_ptr()  # a view of the same storage: nothing copied eagerly


def test_a_compiled_graph_computes_the_same_numbers_through_it():
    def f(x, w):  # a broadcast factor read by every element of a loop, as nuq's key factors are
        return (w.float() * in_buffer(x.abs().sqrt() * 0.5 + 1)[:, None, :]).sum(-1)

    x, w = torch.randn(6, 16), torch.randint(-8, 8, (6, 4, 16), dtype=torch.int8)
    assert torch.allclose(torch.compile(f, dynamic=False)(x, w), f(x, w), rtol=1e-6, atol=1e-6)
