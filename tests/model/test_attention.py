"""The attention op a compiled graph calls (kvserve::paged_attention, kvserve/model/attention.py): it attends the
way the thread that runs the graph said, so engines stepping at once in threads of one process never attend over
each other's cache or metadata."""
import threading

import torch

from kvserve.model.attention import attention_outside_graph, paged_attention


def _op(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvserve.paged_attention(q, q, q, 0, 1.0)


def test_each_thread_attends_as_it_said_inside_nested_contexts():
    q = torch.zeros(2, 1, 4)
    inner_entered, outer_done = threading.Event(), threading.Event()
    seen = {}

    def outer():
        with attention_outside_graph(lambda q, k, v, layer, scale: q + 1):
            inner_entered.wait()  # the other thread is inside a context of its own now ...
            seen["outer"] = float(_op(q)[0, 0, 0])  # ... and this one still attends as it said
            outer_done.set()

    def inner():
        with attention_outside_graph(lambda q, k, v, layer, scale: q + 2):
            inner_entered.set()
            seen["inner"] = float(_op(q)[0, 0, 0])
            outer_done.wait()  # stays inside its context until the other thread has attended

    threads = [threading.Thread(target=outer), threading.Thread(target=inner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"outer": 1.0, "inner": 2.0}
    with attention_outside_graph(lambda q, k, v, layer, scale: q + 3):
        with attention_outside_graph(lambda q, k, v, layer, scale: q + 4):
            assert float(_op(q)[0, 0, 0]) == 4.0
        assert float(_op(q)[0, 0, 0]) == 3.0  # the outer context again


def test_paged_attention_on_a_stand_in_calls_the_op():
    from kvserve.model.attention import AttentionMetadata

    stand_in = AttentionMetadata(positions=torch.zeros(2, dtype=torch.long), slot_mappings=[], groups=[],
                                 layer_group=(0,), outside_graph=True)
    q = torch.ones(2, 1, 4)
    with attention_outside_graph(lambda q, k, v, layer, scale: q * scale + layer):
        out = paged_attention(q, q, q, 3, None, stand_in, 0.5)
    assert torch.equal(out, torch.full((2, 1, 4), 3.5))
