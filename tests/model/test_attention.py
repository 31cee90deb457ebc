"""The attention op a compiled graph calls (kvserve::paged_attention, kvserve/model/attention.py): it attends the
way the thread that runs the graph said, so engines stepping at once in threads of one process never attend over
each other's cache or metadata."""
import threading

import torch

from kvserve.model.attention import attention_outside_graph, paged_attention


def _op(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvserve.paged_attention(q, q, q, torch.tensor(0), 1.0)


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


def test_a_layer_region_compiles_once_for_all_layers_and_attends_with_each_layers_index():
    """run_layer inside a graph with attention outside it: one region, traced once, called by every layer with its
    own weights and index (LayerRegion), giving what the layers give eagerly."""
    from kvserve.model.attention import AttentionMetadata, LayerRegion, run_layer

    class Layer:  # a decoder layer's shape: weights on a plain object, attention through paged_attention
        def __init__(self, seed: int):
            self.weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))

        def forward(self, h, cos, sin, layer, cache, meta):
            q = (h @ self.weight * cos + sin).view(-1, 1, 4)
            return paged_attention(q, q, q, layer, cache, meta, 1.0).view(-1, 4) + h

    layers = [Layer(i) for i in range(5)]
    stand_in = AttentionMetadata(positions=torch.zeros(3, dtype=torch.long), slot_mappings=[], groups=[],
                                 layer_group=(0,) * 5, outside_graph=True,
                                 layer_regions=[LayerRegion(layer, i) for i, layer in enumerate(layers)])
    eager = AttentionMetadata(positions=stand_in.positions, slot_mappings=[], groups=[], layer_group=(0,) * 5,
                              outside_graph=True)

    def forward(h, cos, sin, meta):
        for i, layer in enumerate(layers):
            h = run_layer(layer, h, cos, sin, i, None, meta)
        return h

    graphs = []

    def backend(gm, example_inputs):  # the graph as Dynamo built it, run as it is
        graphs.append(gm)
        return gm

    h, cos, sin = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    with attention_outside_graph(lambda q, k, v, layer, scale: q * (layer + 1)):
        expected = forward(h, cos, sin, eager)
        got = torch.compile(forward, backend=backend, fullgraph=True)(h, cos, sin, stand_in)
    assert torch.allclose(got, expected, atol=1e-5)
    # one region body, called by all five layers: Dynamo traced the first and reused it for the others
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 5 and len({n.args[0].target for n in calls}) == 1
