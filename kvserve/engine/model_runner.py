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
class StepLogits:
    logits: torch.Tensor  # [N, V] float32, row i for seqs[i]: the distribution its next token is sampled from
    seqs: list[Sequence]
    prompt_logits: list[tuple[Sequence, torch.Tensor]]  # [n, V] logits of the next n unscored prompt tokens


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

    def run(self, out: SchedulerOutput) -> StepLogits:
        """Logits of the sequences whose last known token was computed this step, and of the prompt positions
        whose log-probabilities were asked for."""
        input_ids, meta, chunks = self.build_batch(out)
        self.cache.begin_step(self.kv.pool.take_freed(), [(c.src, c.dst) for c in out.block_copies],
                              meta.slot_mapping)
        hidden = self.model.forward(input_ids, meta, self.cache)
        sampling = [(seq, c) for seq, c in zip(out.seqs, chunks) if c.context_len == len(seq.token_ids)]
        rows = torch.tensor([c.offset + c.num_tokens - 1 for _, c in sampling], dtype=torch.long, device=self.device)
        prompt_logits = []
        for seq, c in zip(out.seqs, chunks):
            scored = self._prompt_rows(seq, c)
            if scored is not None:
                prompt_logits.append((seq, self.model.compute_logits(hidden[scored[0] : scored[1]]).cpu()))
        return StepLogits(self.model.compute_logits(hidden[rows]).cpu(), [seq for seq, _ in sampling], prompt_logits)

    @staticmethod
    def _prompt_rows(seq: Sequence, chunk: _Chunk) -> tuple[int, int] | None:
        """Rows of the flat batch whose logits score prompt tokens not scored yet (position p predicts token p+1;
        the last prompt position predicts the first output token, which is sampled, not scored)."""
        if seq.params.prompt_logprobs is None:
            return None
        start = chunk.context_len - chunk.num_tokens
        first = max(start, seq.num_scored_prompt_tokens)  # a recomputed (preempted) prompt is scored once
        end = min(chunk.context_len, seq.num_prompt_tokens - 1)
        if first >= end:
            return None
        return chunk.offset + first - start, chunk.offset + end - start

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
        """Pad the chunks to [S, Q] queries and, unless they are fresh prompts read exactly, describe the [S, B]
        blocks their keys live in with the mask over them."""
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
        if self.cache.exact and all(c.context_len == c.num_tokens > 1 for c in chunks):
            return AttentionGroup(query_index.to(self.device), None, None, out_rows, out_tokens, fresh=True)
        table, mask, residual = self._blocks_and_mask(chunks, lengths, q_idx, valid)
        return AttentionGroup(query_index.to(self.device), table, mask, out_rows, out_tokens, False, residual)

    def _blocks_and_mask(self, chunks: list[_Chunk], lengths: torch.Tensor, q_idx: torch.Tensor, valid: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Block tables, the attention mask over every key the group reads, and (for formats that read a query's
        own block in full precision) the block whose staged tokens precede each chunk."""
        bs = self.block_size
        start = torch.tensor([c.context_len - c.num_tokens for c in chunks])[:, None]
        query_pos = start + q_idx  # [S, Q]
        max_blocks = max(len(c.block_ids) for c in chunks)
        table = torch.tensor([c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks])
        slot_in_table = torch.arange(max_blocks * bs)
        key_pos = slot_in_table.expand(len(chunks), -1)  # logical position of each gathered key
        key_ok = key_pos < torch.tensor([len(c.block_ids) * bs for c in chunks])[:, None]
        stored = torch.ones_like(key_ok)
        residual = None
        if self.cache.exact_own_block:
            own_block = start // bs  # [S, 1]
            staged_pos = own_block * bs + torch.arange(bs)  # the own block's tokens computed in earlier steps
            new_pos = start + q_idx
            key_pos = torch.cat([key_pos, staged_pos, new_pos], dim=1)
            key_ok = torch.cat([key_ok, staged_pos < start, valid], dim=1)
            stored = torch.cat([stored, torch.zeros(len(chunks), bs + len(q_idx), dtype=torch.bool)], dim=1)
            residual = torch.tensor([c.block_ids[c_start // bs] if c_start % bs else -1
                                     for c, c_start in zip(chunks, start.squeeze(1).tolist())])
        visible = key_ok[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])  # [S, Q, K]
        if self.cache.exact_own_block:
            same_block = (key_pos[:, None, :] // bs) == (query_pos[:, :, None] // bs)
            visible &= torch.where(stored[:, None, :], ~same_block, same_block)
        visible &= valid[:, :, None]
        visible[:, :, 0] |= ~valid  # padded query rows see one key, so no row is fully masked
        residual = residual.to(self.device) if residual is not None else None
        return table.to(self.device), visible.unsqueeze(1).to(self.device), residual

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
