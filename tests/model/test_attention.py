"""The attention op a compiled graph calls (kvserve::paged_attention, kvserve/model/attention.py): it attends the
way the thread that runs the graph said, so engines stepping at once in threads of one process never attend over
each other's cache or metadata."""
import threading

import torch

from kvserve.model.attention import attention_outside_graph, paged_attention


def _op(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvserve.paged_attention(q, q, q, torch.tensor(0), 1.0)


class ToyLayer:
    """A decoder layer's shape: weights on a plain object, attention through paged_attention (keys and values
    `k_times` and `v_times` the queries)."""

    def __init__(self, seed: int, k_times: float = 1.0, v_times: float = 1.0, scale: float = 1.0):
        self.weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
        self.k_times, self.v_times, self.scale = k_times, v_times, scale

    def forward(self, h, cos, sin, layer, cache, meta):
        q = (h @ self.weight * cos + sin).view(-1, 1, 4)
        return paged_attention(q, q * self.k_times, q * self.v_times, layer, cache, meta, self.scale).view(-1, 4) + h


def run_layers(layers, h, cos, sin, cache, meta):
    from kvserve.model.attention import run_layer

    for i, layer in enumerate(layers):
        h = run_layer(layer, h, cos, sin, i, cache, meta)
    return h


def graph_capture():
    """A Dynamo backend that keeps each graph as Dynamo built it and runs it as it is, and the list it keeps."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    return graphs, backend


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
    from kvserve.model.attention import AttentionMetadata, LayerRegion

    layers = [ToyLayer(i) for i in range(5)]
    stand_in = AttentionMetadata(positions=torch.zeros(3, dtype=torch.long), slot_mappings=[], groups=[],
                                 layer_group=(0,) * 5, outside_graph=True,
                                 layer_regions=[LayerRegion(layer, i) for i, layer in enumerate(layers)])
    eager = AttentionMetadata(positions=stand_in.positions, slot_mappings=[], groups=[], layer_group=(0,) * 5,
                              outside_graph=True)

    def forward(h, cos, sin, meta):
        return run_layers(layers, h, cos, sin, None, meta)

    graphs, backend = graph_capture()

    h, cos, sin = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    with attention_outside_graph(lambda q, k, v, layer, scale: q * (layer + 1)):
        expected = forward(h, cos, sin, eager)
        got = torch.compile(forward, backend=backend, fullgraph=True)(h, cos, sin, stand_in)
    assert torch.allclose(got, expected, atol=1e-5)
    # one region body, called by all five layers: Dynamo traced the first and reused it for the others
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 5 and len({n.args[0].target for n in calls}) == 1


def test_the_whole_graphs_layer_region_attends_inside_it_over_each_layers_own_rows():
    """run_layer in the whole graph: one region, traced once, that writes each layer's new K/V into that layer's
    own rows of the pool and attends over them (LayerRow), in two layer groups of their own block tables; the
    same output and the same pool as eager."""
    from kvserve.kv.kv_cache import FullPrecisionKVCache
    from kvserve.planner.layout import KVLayout
    from kvserve.kv.readers import AttentionGroup
    from kvserve.model.attention import AttentionMetadata, LayerRegion

    layers, num_seqs, block_size = [ToyLayer(i, k_times=2, v_times=3, scale=0.5) for i in range(4)], 2, 4
    layout = KVLayout.from_layer_windows([8, 8, None, None])  # groups of two layers: sliding {0, 1}, full {2, 3}

    def cache():
        return FullPrecisionKVCache(layout, 8, block_size, 1, 4)

    def step(cache):  # two sequences at position 6 (block 1 of their tables), each group tables of its own
        tables = [torch.tensor([[0, 2], [1, 3]]), torch.tensor([[4, 6], [5, 7]])]
        slots = [t[:, 1] * block_size + 2 for t in tables]
        mask = torch.arange(2 * block_size).expand(num_seqs, 1, 1, -1) <= block_size + 2
        groups = [[AttentionGroup(torch.arange(num_seqs)[:, None], t, mask, None, None)] for t in tables]
        meta = AttentionMetadata(positions=torch.full((num_seqs,), 6), slot_mappings=slots, groups=groups,
                                 layer_group=layout.group_of)
        cache.begin_step([], [], slots)
        return meta

    def forward(h, cos, sin, cache, meta):
        return run_layers(layers, h, cos, sin, cache, meta)

    graphs, backend = graph_capture()

    torch.manual_seed(0)
    h, cos, sin = torch.randn(num_seqs, 4), torch.randn(num_seqs, 4), torch.randn(num_seqs, 4)
    eager_cache, compiled_cache = cache(), cache()
    for c in (eager_cache, compiled_cache):
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(1)))  # keys already there
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(2)))
    expected = forward(h, cos, sin, eager_cache, step(eager_cache))
    regions = [LayerRegion(layer, i, compiled_cache) for i, layer in enumerate(layers)]
    meta, before = step(compiled_cache), compiled_cache.k.clone()
    meta.layer_regions = regions
    got = torch.compile(forward, backend=backend, fullgraph=True)(h, cos, sin, compiled_cache, meta)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(compiled_cache.k, eager_cache.k) and torch.allclose(compiled_cache.v, eager_cache.v)
    assert not torch.equal(compiled_cache.k, before)  # the step wrote its keys (a region writing nothing fails)
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 4 and len({n.args[0].target for n in calls}) == 1
