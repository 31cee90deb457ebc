"""Attention over a flat batch of tokens whose K/V live in the paged cache: the step's metadata, the layer's call
into the cache's reader, and the ways a compiled graph attends.

The batch mixes requests in prefill (many query tokens) and decode (one). Requests with the same kind of work
form a group; each group is one padded attention call per layer (kv/readers.py: AttentionGroup); in
batch-invariant mode (kvserve/batch_invariant.py) the runner builds tile calls instead (TileCall). How a group or
tile is read is the cache's reader's, chosen once when the cache was built (its format's: gathered blocks, or its
compiled decode kernel) and wrapped at start by an eviction policy that scores attention (kv/scored_attention.py):
paged_attention writes the layer's new K/V and hands the reader that layer's calls."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.batch_invariant import RowTiles
from kvserve.kv.kv_cache import LayerRow, PagedKVCache
from kvserve.kv.readers import AttentionGroup, TileCall
from kvserve.kv.scored_attention import AttentionScores
from kvserve.kv.state_cache import StateStep


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the runner and read by every layer."""

    positions: torch.Tensor  # [T]
    slot_mappings: list[torch.Tensor]  # per layer group: [T] where each new token's K/V is written
    groups: list[list[AttentionGroup]]  # per layer group: its attention calls
    layer_group: tuple[int, ...]  # each layer's group (the KV layout)
    # H2O: where each layer adds the attention each key received (its scored reader does; kv/scored_attention.py)
    scores: AttentionScores | None = None
    tiles: RowTiles = field(default_factory=RowTiles)  # how per-token work is cut (batch-invariant mode: tiles)
    tile_calls: list[list[TileCall]] | None = None  # per layer group, batch-invariant mode: replaces `groups`
    # a compiled graph's stand-in for the step: attention runs outside the graph, over the step's own metadata
    # (attention_outside_graph); inside it the graph reads only the positions and the tiles
    outside_graph: bool = False
    # with outside_graph: the model's layers, each the nested compile region the graph calls it as (run_layer)
    layer_regions: list[LayerRegion] | None = None
    state: StateStep | None = None  # hybrid models: where each sequence's linear-layer state lives (state_cache.py)

    def calls_of(self, layer: int) -> list[AttentionGroup] | list[TileCall]:
        """The attention calls of `layer`'s group: its tile calls in batch-invariant mode, else its groups."""
        group = self.layer_group[layer]
        return self.groups[group] if self.tile_calls is None else self.tile_calls[group]


class LayerRegion(torch.nn.Module):
    """A decoder layer and its index as a compiled graph takes them into one nested compile region
    (`torch.compiler.nested_compile_region`, run_layer): Dynamo traces the region once and Inductor compiles it once,
    then every layer alike calls that code with its own weights. Dynamo reuses a traced region only for inputs that
    are tensors, constants or modules, so the layer travels in a module, its index and its row of the cache as
    tensors (one code for all); the whole graph's region attends inside it, over `cache` (LayerRow)."""

    def __init__(self, layer, index: int, cache: PagedKVCache | None = None):
        super().__init__()
        self.layer = layer
        self.index = torch.tensor(index)
        self.cache = cache
        self.row = torch.tensor(cache.layout.row_of[index]) if cache is not None else None


def run_layer(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int, cache: PagedKVCache,
              meta: AttentionMetadata) -> torch.Tensor:
    """`layer.forward` for layer `index`; in a compiled graph whose layers are regions (LayerRegion), as the layers'
    region. Compiling the region once instead of each layer took SmolLM2's graphs from 30 traced layers to one
    (docs/benchmarks.md, start-up)."""
    regions = meta.layer_regions
    if regions is None:
        return layer.forward(h, cos, sin, index, cache, meta)
    if meta.outside_graph:
        return _layer_region(regions[index], h, cos, sin)
    group = meta.layer_group[index]  # the whole graph: one attention call per layer group (CompiledSteps.eligible)
    g = meta.groups[group][0]
    # the mask by block ([S, 1, Q, B, block size]): an input whose size is a product of symbols (B * block size)
    # made Dynamo's reuse of the region fail ("KeyError: 16*s95", torch 2.13)
    mask = g.mask.view(*g.mask.shape[:3], -1, cache.block_size)
    return _whole_layer_region(regions[index], h, cos, sin, meta.slot_mappings[group], g.query_index, g.block_tables,
                               mask)


@torch.compiler.nested_compile_region
def _layer_region(region: LayerRegion, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return region.layer.forward(h, cos, sin, region.index, None, _REGION_STAND_IN)


@torch.compiler.nested_compile_region
def _whole_layer_region(region: LayerRegion, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        slot_mapping: torch.Tensor, query_index: torch.Tensor, block_tables: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """A layer with its attention, as layer 0 of a one-group step over its own row of the cache."""
    group = AttentionGroup(query_index, block_tables, mask.flatten(3), None, None)
    meta = AttentionMetadata(positions=_REGION_STAND_IN.positions, slot_mappings=[slot_mapping], groups=[[group]],
                             layer_group=(0,), tiles=_REGION_STAND_IN.tiles)
    return region.layer.forward(h, cos, sin, 0, LayerRow(region.cache, region.row, slot_mapping), meta)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int | torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens. Returns [T, H, D]. `layer` is a tensor in a layer
    region (run_layer), where attention is outside the graph."""
    if meta.outside_graph:
        return _attention_outside_graph(q, k, v, torch.as_tensor(layer), scale)
    cache.write(layer, k, v)
    return cache.reader.attend(q, k, v, layer, meta.calls_of(layer), scale)


# how the attention op of the graph this thread runs now attends: (q, k, v, layer, scale) -> output, per thread, as
# engines in threads of one process may step at once (attention_outside_graph)
_OUTSIDE_GRAPH = threading.local()


@contextlib.contextmanager
def attention_outside_graph(attend: Callable[..., torch.Tensor]):
    """While a compiled graph runs a step described by a stand-in (`outside_graph`), its attention op calls
    `attend(q, k, v, layer, scale)` (`attend_over` the step's cache and metadata): the step's groups, tables and masks
    never enter the graph, so one graph runs steps of any structure (compile/steps.py)."""
    outer = getattr(_OUTSIDE_GRAPH, "attend", None)
    _OUTSIDE_GRAPH.attend = attend
    try:
        yield
    finally:
        _OUTSIDE_GRAPH.attend = outer


def attend_over(cache: PagedKVCache, meta: AttentionMetadata) -> Callable[..., torch.Tensor]:
    """paged_attention over this step's cache and metadata, for attention_outside_graph."""
    return lambda q, k, v, layer, scale: paged_attention(q, k, v, layer, cache, meta, scale)


@torch.library.custom_op("kvserve::paged_attention", mutates_args=())
def _attention_outside_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """paged_attention as one op a graph calls as it is (it writes the pool, which is no input of the graph: the
    graph orders it by its output, which the next layer reads). The layer is a tensor: the one region all layers
    call passes its own (LayerRegion). It attends in inference mode, as an eager step does (the graph runs under
    no_grad): a KV format's compiled decode kernel (int8, int4) was built for inference tensors, and Dynamo's guards
    compare that: called with others, it compiled again while serving, was refused, and attended eagerly from then
    on, with one warning (tests/compile/test_steps.py checks it no longer does). Its output is contiguous,
    as its fake's is: the graph reads it with the fake's strides (a prompt's rows may come back as a transposed
    view: H2O's written-out attention, SDPA's over one request)."""
    with torch.inference_mode():
        return _OUTSIDE_GRAPH.attend(q, k, v, int(layer), scale).contiguous()


@_attention_outside_graph.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


# what a layer region reads of the step inside it (its tiles: a compiled step's are the default; attention outside)
_REGION_STAND_IN = AttentionMetadata(positions=torch.empty(0, dtype=torch.long), slot_mappings=[], groups=[],
                                     layer_group=(), outside_graph=True)

