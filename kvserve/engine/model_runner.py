"""One forward pass for a scheduled step: flatten the batch, describe it for attention, return logits to sample."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.batch_invariant import RowTiles
from kvserve.engine.attention_tiles import TileChunk, tile_calls
from kvserve.compile.steps import CompiledSteps
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence
from kvserve.engine.attention_mask import GroupChunk, group_keys
from kvserve.kv.draft_states import DraftStates
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.kv_cache_manager import BlockTable, KVCacheManager
from kvserve.kv.readers import AttentionGroup
from kvserve.kv.resume import DECODE
from kvserve.kv.scored_attention import AttentionScores
from kvserve.kv.state_cache import StateCache, StateStep
from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaModel


@dataclass
class StepLogits:
    logits: torch.Tensor  # [N, V] float32, row i for seqs[i]: the distribution its next token is sampled from
    seqs: list[Sequence]
    prompt_logits: list[tuple[Sequence, torch.Tensor]]  # [n, V] logits of the next n unscored prompt tokens
    # speculative decoding: [1 + k, V] logits of a drafted sequence's last token and its k draft tokens
    draft_logits: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Chunk:
    offset: int  # index of the chunk's first token in the flat batch
    num_tokens: int
    context_len: int  # tokens computed after this step, chunk included
    tables: list[BlockTable]  # the sequence's kept blocks, per layer group
    slots: list[list[int]]  # cache slot of each new token, per layer group

    @property
    def start(self) -> int:
        return self.context_len - self.num_tokens


# A bucket's requests are padded to its longest context; a request joins it only if that wastes at most a third
# of its keys. Fewer, larger attention calls cost less per call; less padding costs less per key. Both matter.
MIN_BUCKET_FILL = 0.75


def _buckets(chunks: list[_Chunk], group: int) -> list[list[_Chunk]]:
    """Split chunks of one kind (decode or prefill) into groups of similar key counts in one layer group."""
    buckets: list[list[_Chunk]] = []
    keys = lambda c: len(c.tables[group].blocks)  # noqa: E731
    for chunk in sorted(chunks, key=keys, reverse=True):
        if buckets and keys(chunk) >= MIN_BUCKET_FILL * keys(buckets[-1][0]):
            buckets[-1].append(chunk)
        else:
            buckets.append([chunk])
    return [sorted(b, key=lambda c: c.offset) for b in buckets]  # batch order: a whole-batch bucket needs no scatter


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager, device: str = "cpu",
                 scores: AttentionScores | None = None, tiles: RowTiles | None = None,
                 compiled: CompiledSteps | None = None, state_cache: StateCache | None = None):
        self.model = model
        self.state_cache = state_cache  # hybrid models: the linear layers' state slots (kv.state says whose)
        self.cache = cache
        self.kv = kv
        self.block_size = kv.block_size
        self.device = device
        self.scores = scores  # H2O's accumulated attention, when the eviction policy needs it
        # the eviction policy's scored attention, where it needs one, wraps the format's reader once, here
        cache.reader = kv.eviction.attention_reader(cache.reader, scores)
        self.tiles = tiles or RowTiles()  # batch-invariant mode: fixed token tiles and per-tile attention
        self.compiled = compiled  # steps as compiled graphs (compile/steps.py)
        self.num_steps = self.num_compiled_steps = 0  # steps run, and of those steps run by a compiled graph
        self.drafted_states: DraftStates | None = None  # hybrid models: the last step's drafted sequences' states

    def run(self, out: SchedulerOutput) -> StepLogits:
        """Logits of the sequences whose last known token was computed this step, and of the prompt positions
        whose log-probabilities were asked for."""
        input_ids, meta, chunks = self.build_batch(out)
        freed = self.kv.pool.take_freed()
        self.cache.begin_step(freed, [(c.src, c.dst) for c in out.block_copies], meta.slot_mappings)
        if self.state_cache is not None:
            self.state_cache.copy(self.kv.state.take_copies())  # forked sequences' states, before they run
        if self.scores is not None:
            self.scores.reset(freed)
        hidden = None
        self.num_steps += 1
        if self.compiled is not None:
            hidden = self.compiled.forward(input_ids, meta)
            self.num_compiled_steps += hidden is not None
        if hidden is None:
            hidden = self.model.forward(input_ids, meta, self.cache)
        sampling = [(seq, c) for seq, c in zip(out.seqs, chunks) if c.context_len == len(seq.token_ids)]
        rows = torch.tensor([c.offset + c.num_tokens - 1 for _, c in sampling], dtype=torch.long, device=self.device)
        prompt_logits = []
        for seq, c in zip(out.seqs, chunks):
            scored = self._prompt_rows(seq, c)
            if scored is not None:
                prompt_logits.append((seq, self._logits(hidden[scored[0] : scored[1]])))
        draft_logits = [(seq, self._logits(hidden[c.offset : c.offset + c.num_tokens]))
                        for seq, c in zip(out.seqs, chunks) if seq.request_id in out.drafts]
        return StepLogits(self._logits(hidden[rows]), [seq for seq, _ in sampling], prompt_logits, draft_logits)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.compiled.logits(hidden) if self.compiled is not None else None  # one row: compiled head
        if logits is None:
            logits = self.tiles.map(self.model.compute_logits, hidden)
        return logits.cpu()

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
        tokens, positions, chunks = [], [], []
        num_groups = self.kv.num_groups
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            tables = [self.kv.block_table(seq.request_id, g) for g in range(num_groups)]
            chunks.append(_Chunk(len(tokens), n, start + n, tables, [self._slots(t, start, n) for t in tables]))
            draft = out.drafts.get(seq.request_id, [])  # verified after the sequence's last token
            tokens.extend((seq.token_ids + draft if draft else seq.token_ids)[start : start + n])
            positions.extend(range(start, start + n))
        slot_mappings, groups = [], []
        # decode attention that reads blocks where they lie pads nothing: every decode in one call
        in_place = self.cache.reader.reads_decodes_in_place()
        for g in range(num_groups):
            slot_mappings.append(self._tensor([slot for c in chunks for slot in c.slots[g]]))
            if self.tiles:
                continue
            decodes = [c for c in chunks if c.num_tokens == 1]
            buckets = ([decodes] if decodes and in_place else _buckets(decodes, g)) + \
                _buckets([c for c in chunks if c.num_tokens > 1], g)
            groups.append([self._group(bucket, g, whole_batch=len(bucket) == len(chunks)) for bucket in buckets])
        meta = AttentionMetadata(positions=self._tensor(positions), slot_mappings=slot_mappings, groups=groups,
                                 layer_group=self.cache.layout.group_of, scores=self.scores, tiles=self.tiles,
                                 tile_calls=self._tile_calls(chunks) if self.tiles else None,
                                 state=self._state_step(out, chunks) if self.state_cache is not None else None)
        return self._tensor(tokens), meta, chunks

    def _state_step(self, out: SchedulerOutput, chunks: list[_Chunk]) -> StateStep:
        """Each sequence's state slot for the linear layers (decodes batched, prompt chunks batched by StateStep,
        drafted sequences one by one), and the block boundaries where its state is saved as a checkpoint (a drafted sequence's once
        its draft is verified: keep_drafted_state)."""
        cache = self.state_cache
        drafts = DraftStates(cache.conv, cache.recurrent) if out.drafts else None
        self.drafted_states = drafts
        decode_rows, decode_slots, decode_checkpoints, prompt_chunks = [], [], [], []
        for seq, c in zip(out.seqs, chunks):
            slot = self.kv.state.slot(seq.request_id)
            if seq.request_id in out.drafts:
                drafts.add(seq.request_id, slice(c.offset, c.offset + c.num_tokens), slot, c.start)
                continue
            checkpoints = sorted((boundary - c.start, checkpoint) for boundary, kind
                                 in self.kv.checkpoint_boundaries(seq, seq.num_prompt_tokens, c.start, c.context_len)
                                 if (checkpoint := self.kv.plan_checkpoint(seq, boundary, kind)) is not None)
            if c.num_tokens == 1 and c.start > 0:
                decode_rows.append(c.offset)
                decode_slots.append(slot)
                decode_checkpoints += [(slot, checkpoint) for _, checkpoint in checkpoints]
            else:
                prompt_chunks.append((slice(c.offset, c.offset + c.num_tokens), slot, c.start == 0, checkpoints))
        return StateStep.of(cache, decode_rows, decode_slots, self.device, prompt_chunks, decode_checkpoints, drafts)

    def keep_drafted_state(self, seq: Sequence) -> None:
        """After verifying `seq`'s draft (its computed tokens now end at the last accepted one): its state slot as
        of that token, and a checkpoint at the block boundary the accepted tokens passed, if they passed one."""
        start = self.drafted_states.start(seq.request_id) if self.drafted_states is not None else None
        if start is None:
            return
        self.drafted_states.keep(seq.request_id, seq.num_computed_tokens - start)
        boundary = seq.num_computed_tokens // self.block_size * self.block_size
        if self.kv.checkpoints is not None and boundary > start:
            checkpoint = self.kv.plan_checkpoint(seq, boundary, DECODE, saved_now=True)
            if checkpoint is not None:
                self.drafted_states.keep(seq.request_id, boundary - start, into=checkpoint)
        self.drafted_states.drop(seq.request_id)

    def _tile_calls(self, chunks: list[_Chunk]) -> list[list]:
        """Batch-invariant attention: per layer group, the query tiles of every chunk (engine/attention_tiles.py)."""
        return [tile_calls([TileChunk(c.offset, c.start, c.context_len, c.tables[g]) for c in chunks],
                           self.block_size, self.kv.windows[g], self.cache.exact_own_block, self.device)
                for g in range(self.kv.num_groups)]

    def _slots(self, table: BlockTable, start: int, n: int) -> list[int]:
        bs = self.block_size
        first = table.index(start // bs)  # the chunk's blocks are the table's newest, in order
        return [table.blocks[first + p // bs - start // bs].block_id * bs + p % bs for p in range(start, start + n)]

    def _group(self, chunks: list[_Chunk], group: int, whole_batch: bool) -> AttentionGroup:
        """Pad the chunks to [S, Q] queries and, unless they are fresh prompts read exactly, describe the [S, B]
        blocks their keys live in and which query sees which key."""
        num_q = max(c.num_tokens for c in chunks)
        q_idx = torch.arange(num_q)
        offsets = torch.tensor([c.offset for c in chunks])[:, None]
        lengths = torch.tensor([c.num_tokens for c in chunks])[:, None]
        valid = q_idx[None, :] < lengths  # [S, Q]
        query_index = torch.where(valid, offsets + q_idx, 0)
        out_rows = out_tokens = None
        if not (whole_batch and bool(valid.all())):
            rows = valid.reshape(-1).nonzero().squeeze(1)  # indexed here, on the CPU, then moved
            out_rows, out_tokens = rows.to(self.device), query_index.reshape(-1)[rows].to(self.device)
        window = self.kv.windows[group]
        plain = self.cache.exact and not self.kv.eviction.evicts and (window is None or num_q <= window)
        if plain and all(c.context_len == c.num_tokens > 1 for c in chunks):
            return AttentionGroup(query_index.to(self.device), None, None, out_rows, out_tokens, fresh=True)
        keys = group_keys([GroupChunk(c.start, c.num_tokens, [b.block_id for b in c.tables[group].blocks],
                                      c.tables[group].logical, c.slots[group]) for c in chunks],
                          q_idx, valid, self.block_size, self.cache.exact_own_block, self.kv.eviction, window,
                          getattr(self.model, "rotary", None))
        dev = self.device
        return AttentionGroup(
            query_index.to(dev), keys.table.to(dev), keys.mask.to(dev), out_rows, out_tokens, False,
            residual_blocks=_to(keys.residual_blocks, dev),
            key_slots=keys.key_slots.to(dev) if self.scores is not None else None,
            query_valid=valid.to(dev) if self.scores is not None else None,
            sink_keys=_to(keys.sink_keys, dev),
            sink_rotation=tuple(t.to(dev) for t in keys.sink_rotation) if keys.sink_rotation else None,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _to(tensor: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return tensor.to(device) if tensor is not None else None
