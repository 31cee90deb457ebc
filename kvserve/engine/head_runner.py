"""The runner of `--kv-eviction adakv` (and its kin): a step over per-(layer, KV head) streams (kv/head_streams.py).

It flattens the batch as ModelRunner does, but describes attention per stream: the slots each new token takes in
every (layer, head) stream, and one call for the step's decodes and one per prompt chunk, each with its block tables
as one tensor [layers, S, heads, B] and the streams' lengths. After the forward, the step's queries join each
sequence's statistics, which the expected-attention scorer reads when the manager compresses."""
from __future__ import annotations

import torch

from kvserve.engine.model_runner import ModelRunner, StepLogits, _Chunk
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.kv.head_manager import HeadStreamManager
from kvserve.kv.head_streams import FAR_POSITION, HeadCall, HeadStreamKVCache, QueryRecord
from kvserve.model.attention import AttentionMetadata


class HeadStreamRunner(ModelRunner):
    """ModelRunner over a HeadStreamKVCache, whose only layer group is held by a HeadStreamManager."""

    cache: HeadStreamKVCache

    @property
    def heads(self) -> HeadStreamManager:
        return self.kv.groups[0]

    def run(self, out: SchedulerOutput) -> StepLogits:
        step = super().run(out)
        self.cache.end_head_step()
        return step

    def build_batch(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, list[_Chunk]]:
        tokens, positions, chunks, slots, sequence_of, drafted = [], [], [], [], [], []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            start = seq.num_computed_tokens
            slots.append(self.heads.reserve(seq.request_id, n))  # [L, H, n]
            chunks.append(_Chunk(len(tokens), n, start + n, [], []))
            draft = out.drafts.get(seq.request_id, [])  # verified after the sequence's last token
            tokens.extend((seq.token_ids + draft if draft else seq.token_ids)[start : start + n])
            positions.extend(range(start, start + n))
            sequence_of += [i] * n
            drafted += [False] * (n - len(draft)) + [True] * len(draft)
        step_positions = self._tensor(positions)
        cos, sin = self.model.rotary.lookup(step_positions)
        # the statistics count every token but the sinks and draft tokens (which may be rejected, and an accepted
        # one is not computed again: its query is not counted)
        counted = (step_positions >= self.kv.eviction.sink_tokens) & ~self._tensor(drafted).bool()
        record = QueryRecord([s.request_id for s in out.seqs], self._tensor(sequence_of), counted.float(),
                             cos.float(), sin.float())
        self.cache.begin_head_step(torch.cat(slots, dim=2).permute(0, 2, 1).to(self.device), step_positions,
                                   self.heads.take_fresh_blocks(), record)
        decodes = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        parts = ([decodes] if decodes else []) + [[i] for i, c in enumerate(chunks) if c.num_tokens > 1]
        calls = [self._call(out.seqs, chunks, part, whole_batch=len(part) == len(chunks)) for part in parts]
        meta = AttentionMetadata(positions=step_positions, slot_mappings=[], groups=[calls],
                                 layer_group=self.cache.layout.group_of)
        return self._tensor(tokens), meta, chunks

    def _call(self, seqs: list[Sequence], chunks: list[_Chunk], part: list[int], whole_batch: bool) -> HeadCall:
        """One attention call for the chunks at `part`: queries padded to the longest, tables to the widest."""
        num_q = max(chunks[i].num_tokens for i in part)
        q_idx = torch.arange(num_q)
        offsets = torch.tensor([chunks[i].offset for i in part])[:, None]
        starts = torch.tensor([chunks[i].start for i in part])[:, None]
        valid = q_idx[None, :] < torch.tensor([chunks[i].num_tokens for i in part])[:, None]
        query_index = torch.where(valid, offsets + q_idx, 0)
        out_rows = out_tokens = None
        if not (whole_batch and bool(valid.all())):
            rows = valid.reshape(-1).nonzero().squeeze(1)
            out_rows, out_tokens = rows.to(self.device), query_index.reshape(-1)[rows].to(self.device)
        streams = [self.heads.streams[seqs[i].request_id] for i in part]
        width = max(int(s.num_blocks.max()) for s in streams)
        tables = torch.full((self.heads.num_layers, len(part), self.heads.num_heads, width), self.heads.null_block,
                            dtype=torch.long)
        for j, s in enumerate(streams):
            held = min(width, s.tables.shape[2])
            tables[:, j, :, :held] = s.tables[:, :, :held]
        lengths = torch.stack([s.lengths for s in streams], dim=1)
        dev = self.device
        return HeadCall(query_index.to(dev), torch.where(valid, starts + q_idx, FAR_POSITION).to(dev),
                        tables.to(dev), lengths.to(dev), out_rows, out_tokens)
