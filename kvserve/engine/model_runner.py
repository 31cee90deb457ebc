"""One forward pass for a scheduled step: flatten the batch, describe it for attention, return logits to sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.model.attention import AttentionGroup, AttentionMetadata
from kvserve.model.llama import LlamaModel


@dataclass
class _Chunk:
    offset: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_len: int  # tokens in the cache after this step, chunk included
    block_ids: list[int]


# A bucket's requests are padded to its longest context; a request joins it only if that wastes at most a third
# of its keys. Fewer, larger attention calls cost less per call; less padding costs less per key. Both matter.
MIN_BUCKET_FILL = 0.75


def _buckets(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Split chunks of one kind (decode or prefill) into groups of similar context length, longest first."""
    buckets: list[list[_Chunk]] = []
    for chunk in sorted(chunks, key=lambda c: c.context_len, reverse=True):
        if buckets and chunk.context_len >= MIN_BUCKET_FILL * buckets[-1][0].context_len:
            buckets[-1].append(chunk)
        else:
            buckets.append([chunk])
    return [sorted(b, key=lambda c: c.offset) for b in buckets]  # batch order: a whole-batch bucket needs no scatter


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager, device: str = "cpu"):
        self.model = model
        self.cache = cache
        self.kv = kv
        self.block_size = kv.block_size
        self.device = device

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [N, V] for the N sequences whose last known token was computed this step, and those sequences."""
        self.cache.copy_blocks([(c.src, c.dst) for c in out.block_copies])
        input_ids, meta, chunks = self.build_batch(out)
        hidden = self.model.forward(input_ids, meta, self.cache)
        sampling = [(seq, c) for seq, c in zip(out.seqs, chunks) if c.context_len == len(seq.token_ids)]
        rows = torch.tensor([c.offset + c.num_tokens - 1 for _, c in sampling], dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]).cpu(), [seq for seq, _ in sampling]

    def build_batch(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, list[_Chunk]]:
        tokens, positions, slots, chunks = [], [], [], []
        bs = self.block_size
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            block_ids = self.kv.block_ids(seq.request_id)
            chunks.append(_Chunk(len(tokens), n, start + n, block_ids))
            tokens.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
        buckets = _buckets([c for c in chunks if c.num_tokens == 1]) + _buckets([c for c in chunks if c.num_tokens > 1])
        groups = [self._group(g, whole_batch=len(g) == len(chunks)) for g in buckets]
        meta = AttentionMetadata(
            positions=self._tensor(positions), slot_mapping=self._tensor(slots), groups=groups
        )
        return self._tensor(tokens), meta, chunks

    def _group(self, chunks: list[_Chunk], whole_batch: bool) -> AttentionGroup:
        """Pad the chunks to [S, Q] queries and, unless they are fresh prompts, describe the [S, B] blocks their
        keys live in with a causal mask over them."""
        num_q = max(c.num_tokens for c in chunks)
        q_idx = torch.arange(num_q)
        offsets = torch.tensor([c.offset for c in chunks])[:, None]
        lengths = torch.tensor([c.num_tokens for c in chunks])[:, None]
        valid = q_idx[None, :] < lengths  # [S, Q]
        query_index = torch.where(valid, offsets + q_idx, 0)
        out_rows = out_tokens = None
        if not (whole_batch and bool(valid.all())):
            out_rows = valid.reshape(-1).nonzero().squeeze(1).to(self.device)
            out_tokens = query_index.reshape(-1)[out_rows].to(self.device)
        fresh = all(c.context_len == c.num_tokens > 1 for c in chunks)
        table, mask = (None, None) if fresh else self._blocks_and_mask(chunks, lengths, q_idx, valid)
        return AttentionGroup(query_index.to(self.device), table, mask, out_rows, out_tokens, fresh)

    def _blocks_and_mask(self, chunks: list[_Chunk], lengths: torch.Tensor, q_idx: torch.Tensor,
                         valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        context = torch.tensor([c.context_len for c in chunks])[:, None]
        query_pos = torch.where(valid, context - lengths + q_idx, 0)  # padded rows attend to key 0 only
        max_blocks = -(-int(context.max()) // bs)
        table = torch.tensor([c.block_ids[:max_blocks] + [0] * (max_blocks - len(c.block_ids[:max_blocks]))
                              for c in chunks])
        key_pos = torch.arange(max_blocks * bs)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
        return table.to(self.device), mask.to(self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
