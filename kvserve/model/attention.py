"""Attention over a flat batch of tokens whose K/V live in the paged cache.

The batch mixes requests in prefill (many query tokens) and decode (one). Requests with the same kind of work
form a group; each group is one padded attention call per layer, over K/V gathered from the cache in whole
blocks. A format that keeps a sequence's newest tokens in full precision (int4) adds them as extra keys after the
gathered ones; the runner's mask says which query sees which key. Groups are one fused scaled-dot-product call,
except where the scores themselves are needed: H2O accumulates them, and StreamingLLM scores its sink keys with a
differently rotated query.

In batch-invariant mode (kvserve/batch_invariant.py) the runner builds tile calls instead of groups: each query
tile is the positions of one KV block of one request, attended over exactly the keys those positions reach, and
tiles with the same number of keys share a call; a query's result then depends on its own context alone."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.batch_invariant import RowTiles
from kvserve.kv.eviction import AttentionScores
from kvserve.kv.kv_cache import LayerRow, PagedKVCache
from kvserve.model.rotary import apply_rotary


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [S, Q] flat token index of each (request, query row); padding points at 0
    block_tables: torch.Tensor | None  # [S, B] each request's blocks, padded with block 0 (None when fresh)
    mask: torch.Tensor | None  # [S, 1, Q, keys] True where that query may attend to that key
    out_rows: torch.Tensor | None  # [M] rows of the padded [S*Q] output that are real tokens (None: all are)
    out_tokens: torch.Tensor | None  # [M] flat token index of each of those rows (None: rows are tokens in order)
    fresh: bool = False  # every request starts at position 0 and reads exactly: its keys are this step's own
    # cache.exact_own_block: the block whose staged, full-precision tokens precede each request's chunk (-1: none);
    # keys are then [gathered blocks | that block's staged tokens | the chunk's new tokens]
    residual_blocks: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None  # [S, keys] cache slot of each key (-1: none), where H2O adds scores
    query_valid: torch.Tensor | None = None  # [S, Q] real (not padded) query rows, for H2O
    sink_keys: torch.Tensor | None = None  # [S, A] which of the first A keys are StreamingLLM sinks ...
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # ... scored with queries rotated by this


@dataclass
class TileCall:
    """Batch-invariant attention for S query tiles, each P positions of one KV block of one request (P the same for
    the whole call), over the B blocks their keys live in: the same B for every tile, the tile's own block last."""

    query_index: torch.Tensor  # [S, P] flat token index of each position
    block_tables: torch.Tensor  # [S, B] blocks holding the keys, in order
    own_blocks: torch.Tensor  # [S] each tile's own block (block_tables[:, -1])
    mask: torch.Tensor  # [S, P, B * block_size] True where that position may attend to that key
    # cache.exact_own_block (int4): the own block read in full precision, offset by offset, from staging (tokens of
    # earlier steps) or from this step's new tokens; None for other formats, which read the own block as stored
    staged: torch.Tensor | None = None  # [S, block_size] offsets read from staging
    own_index: torch.Tensor | None = None  # [S, block_size] flat token index of the other offsets (0: unused)


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the runner and read by every layer."""

    positions: torch.Tensor  # [T]
    slot_mappings: list[torch.Tensor]  # per layer group: [T] where each new token's K/V is written
    groups: list[list[AttentionGroup]]  # per layer group: its attention calls
    layer_group: tuple[int, ...]  # each layer's group (the KV layout)
    scores: AttentionScores | None = None  # H2O: where each layer adds the attention each key received
    tiles: RowTiles = field(default_factory=RowTiles)  # how per-token work is cut (batch-invariant mode: tiles)
    tile_calls: list[list[TileCall]] | None = None  # per layer group, batch-invariant mode: replaces `groups`
    # a compiled graph's stand-in for the step: attention runs outside the graph, over the step's own metadata
    # (attention_outside_graph); inside it the graph reads only the positions and the tiles
    outside_graph: bool = False
    # with outside_graph: the model's layers, each the nested compile region the graph calls it as (run_layer)
    layer_regions: list[LayerRegion] | None = None


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
    group = meta.layer_group[index]  # the whole graph: one attention call per layer group (CompiledDecode.eligible)
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
    if meta.tile_calls is not None:
        return _tile_attention(q, k, v, layer, cache, meta, scale)
    groups = meta.groups[meta.layer_group[layer]]
    if len(groups) == 1 and groups[0].out_rows is None:
        return _group_attention(q, k, v, layer, cache, meta, groups[0], scale).reshape(q.shape)
    out = torch.empty_like(q)
    for group in groups:
        rows = _group_attention(q, k, v, layer, cache, meta, group, scale).reshape(-1, *q.shape[1:])
        out[group.out_tokens] = rows[group.out_rows] if group.out_rows is not None else rows
    return out


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


def _group_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: PagedKVCache, meta: AttentionMetadata,
    group: AttentionGroup, scale: float,
) -> torch.Tensor:
    queries = q[group.query_index]  # [S, Q, H, D]
    S, Q, H, D = queries.shape
    if Q == 1 and cache.fused_decode is not None and not group.fresh and meta.scores is None and \
            group.sink_rotation is None:
        kv_heads = k.shape[1]  # decode: a quantized format may attend over its stored form (compiled)
        out = cache.decode_attention(layer, queries.view(S, kv_heads, H // kv_heads, D), group.block_tables,
                                     group.residual_blocks, k[group.query_index], v[group.query_index], group.mask,
                                     scale)
        if out is not None:
            return out.reshape(S, Q, H, D)
    if group.fresh:
        # Prompts computed from their first token: the keys are the new tokens themselves, and plain causal
        # masking is exact even with padding (a real query never sees a later, padded key) and skips half the work.
        keys, values, mask = k[group.query_index], v[group.query_index], None
    else:
        if group.residual_blocks is None:
            keys, values = cache.gather(layer, group.block_tables)  # [S, C, KVH, D]
        else:
            keys, values = cache.gather_with_own_block(layer, group.block_tables, group.residual_blocks,
                                                       k[group.query_index], v[group.query_index])
        mask = group.mask
    rotation = None if group.fresh else cache.rotation  # stored K/V are rotated: rotate queries alike, undo after
    if meta.scores is not None or group.sink_rotation is not None:
        out = _scored_attention(queries, keys, values, mask, scale, group, meta.scores, rotation)
        return out if rotation is None else out @ rotation.T
    if rotation is not None:
        queries = queries @ rotation
    kv_heads = keys.shape[2]
    if Q == 1 and mask is not None:
        # Decode: the query heads that share a KV head become that head's query rows (one mask row fits all), so
        # the call needs no grouped-query support. On a CPU that is faster than enable_gqa: attention's share of
        # float32 decode-heavy time fell from 17.9% to 15.4% (`kvserve bench throughput --profile`). Prefill
        # stays grouped: its mask would have to be repeated per head, which measured slower.
        out = F.scaled_dot_product_attention(queries.view(S, kv_heads, H // kv_heads, D), keys.transpose(1, 2),
                                             values.transpose(1, 2), attn_mask=mask, scale=scale)
        out = out.reshape(S, Q, H, D)  # a view where the kernel wrote it contiguously (the CPU's); CUDA's may not
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)  # [S, Q, H, D]
    return out if rotation is None else out @ rotation.T


def _tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: PagedKVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Every query over its own tile's keys (batch-invariant mode). Each position of a tile is a query head of its
    own with one query row, so the kernel computes every query alike — a [1, D] x [D, keys] problem, whether the
    position is decoded alone or prefilled with its block — and rows never mix; keys are shared through GQA."""
    rotation = cache.rotation
    if rotation is not None:  # stored K/V are rotated (fp8): queries alike, output back, token by token
        q = meta.tiles.map(lambda x: x @ rotation, q)
    out = torch.empty_like(q)
    bs, heads, dim = cache.block_size, q.shape[1], q.shape[2]
    for call in meta.tile_calls[meta.layer_group[layer]]:
        keys, values = cache.gather(layer, call.block_tables)  # [S, B * bs, KVH, D]
        if call.staged is not None:  # the own block in full precision: staged tokens, then this step's
            staged_k, staged_v = cache.gather_residual(layer, call.own_blocks)
            earlier = call.staged[:, :, None, None]
            keys[:, -bs:] = torch.where(earlier, staged_k, k[call.own_index])
            values[:, -bs:] = torch.where(earlier, staged_v, v[call.own_index])
        (S, P), kv_heads, num_keys = call.query_index.shape, keys.shape[2], keys.shape[1]
        per_kv = heads // kv_heads
        # [S, P, H, D] -> heads ordered (kv head, position, query head of that kv head): GQA maps each to its kv head
        queries = q[call.query_index].view(S, P, kv_heads, per_kv, dim).transpose(1, 2).reshape(S, -1, 1, dim)
        mask = call.mask[:, None, :, None, :].expand(S, kv_heads, P, per_kv, num_keys).reshape(S, -1, 1, num_keys)
        rows = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                              scale=scale, enable_gqa=True)  # [S, KVH * P * per_kv, 1, D]
        out[call.query_index.reshape(-1)] = rows.reshape(S, kv_heads, P, per_kv, dim).transpose(1, 2).reshape(
            -1, heads, dim)
    return out if rotation is None else meta.tiles.map(lambda x: x @ rotation.T, out)


def _scored_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, group: AttentionGroup, scores: AttentionScores | None,
                      rotation: torch.Tensor | None) -> torch.Tensor:
    """Attention written out, for when the probabilities are needed or sink keys take a rotated query. With a
    storage `rotation`, the output is in rotated coordinates (the caller rotates it back)."""
    S, Q, H, D = queries.shape
    kv_heads = keys.shape[2]
    per_kv = H // kv_heads

    def logits(qs: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:  # [S, KVH, per_kv * Q, K]
        if rotation is not None:  # after RoPE (the sink rotation included): stored keys were rotated after it
            qs = qs @ rotation
        qs = qs.view(S, Q, kv_heads, per_kv, D).permute(0, 2, 3, 1, 4).reshape(S, kv_heads, per_kv * Q, D)
        return qs @ ks.permute(0, 2, 3, 1) * scale

    weights = logits(queries, keys)
    if group.sink_rotation is not None:
        cos, sin = group.sink_rotation
        num_sink = group.sink_keys.shape[1]
        rotated = logits(apply_rotary(queries, cos, sin), keys[:, :num_sink])
        is_sink = group.sink_keys[:, None, None, :]
        weights[..., :num_sink] = torch.where(is_sink, rotated, weights[..., :num_sink])
    weights = weights.view(S, kv_heads, per_kv, Q, -1).masked_fill(~mask.view(S, 1, 1, Q, -1), float("-inf"))
    probs = weights.softmax(dim=-1)
    if scores is not None:
        received = (probs * group.query_valid.view(S, 1, 1, Q, 1)).sum(dim=(1, 2, 3))  # [S, K]
        taken = group.key_slots >= 0
        scores.per_slot.index_add_(0, group.key_slots[taken], received[taken].float())
    out = probs.view(S, kv_heads, per_kv * Q, -1) @ values.permute(0, 2, 1, 3)  # [S, KVH, per_kv * Q, D]
    return out.view(S, kv_heads, per_kv, Q, D).permute(0, 3, 1, 2, 4).reshape(S, Q, H, D)
