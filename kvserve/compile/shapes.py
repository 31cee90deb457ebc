"""The shapes a compiled step is traced and run at: Dynamo specializes a size of 1, so one-block tables are widened
to two, one sequence under --compile-gemms runs as two rows, and the step's other sizes are marked as symbols."""
from __future__ import annotations

from dataclasses import replace

import torch

from kvserve.model.attention import AttentionMetadata

def at_least_two_blocks(meta: AttentionMetadata) -> AttentionMetadata:
    """The step with each one-block table widened to two (the first block again, its keys masked out). Dynamo
    specializes a size of 1 rather than make it a symbol, so contexts of up to one block would need a graph of
    their own; a masked key adds exp(-inf) = 0 to the softmax."""
    if all(groups[0].block_tables.shape[1] > 1 for groups in meta.groups):
        return meta
    widened = []
    for groups in meta.groups:
        g = groups[0]
        if g.block_tables.shape[1] == 1:
            hidden = torch.zeros_like(g.mask)
            g = replace(g, block_tables=g.block_tables.repeat(1, 2), mask=torch.cat([g.mask, hidden], dim=3))
        widened.append([g])
    return replace(meta, groups=widened)


def two_rows(input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """--compile-gemms: a one-sequence step as two identical sequences, so that it runs the graph of several (Dynamo
    specializes a size of 1, so one sequence would need a graph of its own, compiled at every start and holding a
    second packed copy of the weights). The copy computes the same keys and values from the same inputs and writes
    them to the same slots; its output row is dropped. Without --compile-gemms one sequence keeps its own graph: there
    its matmuls are BLAS calls, and MKL's matrix-vector product (one row) can be much faster than its two-row product
    (docs/benchmarks.md), while a graph without frozen weights costs no memory and is cached."""
    groups = [[replace(g, query_index=torch.arange(2, device=g.query_index.device)[:, None],
                       block_tables=g.block_tables.repeat(2, 1), mask=g.mask.repeat(2, 1, 1, 1))]
              for g in (groups[0] for groups in meta.groups)]
    meta = replace(meta, positions=meta.positions.repeat(2), groups=groups,
                   slot_mappings=[slots.repeat(2) for slots in meta.slot_mappings])
    return input_ids.repeat(2), meta


def mark_sequences(input_ids: torch.Tensor, stand_in: AttentionMetadata) -> None:
    """The number of sequences is a symbol in the graph with attention outside, where it is above 1 (one sequence
    is a graph of its own)."""
    if input_ids.shape[0] > 1:
        for tensor in (input_ids, stand_in.positions):
            torch._dynamo.mark_dynamic(tensor, 0)


def mark_dynamic(input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
    """The step's sizes are symbols in the whole graph (the weights' are not): the number of sequences S, where it
    is above 1 (--compile-gemms; one sequence is a graph of its own), and the block-table width B of each layer
    group (at least 2: at_least_two_blocks)."""
    if input_ids.shape[0] > 1:
        for tensor in (input_ids, meta.positions, *meta.slot_mappings):
            torch._dynamo.mark_dynamic(tensor, 0)
    for groups in meta.groups:
        g = groups[0]
        if input_ids.shape[0] > 1:
            torch._dynamo.mark_dynamic(g.query_index, 0)
            torch._dynamo.mark_dynamic(g.block_tables, 0)
            torch._dynamo.mark_dynamic(g.mask, 0)
        torch._dynamo.mark_dynamic(g.block_tables, 1)
        torch._dynamo.mark_dynamic(g.mask, 3)
