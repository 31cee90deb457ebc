"""Continuous batching: which sequences run this step, with how many tokens each, within the token and block budgets.

Running sequences go first (decodes before unfinished prefills, so a long prompt never starves them); when one
needs a block and none is free, the most recently admitted sequence is preempted: its blocks are freed and it
waits at the front of the queue to be recomputed. Waiting sequences are admitted only when their blocks fit."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.kv.kv_cache_manager import BlockCopy, KVCacheManager


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # parallel to seqs
    block_copies: list[BlockCopy] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # first scheduled this step (some from preemption)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A forked sibling starts out running, right after the sequence it shares blocks with."""
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        copies: dict[str, list[BlockCopy]] = {}
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1):
            budget = self.max_num_batched_tokens - out.num_tokens
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while (result := self.kv.allocate(seq, n)) is None:
                victim = self.running[-1]
                self._preempt(victim, out, copies)
                preempted = True
                if victim is seq:
                    break
            if result is not None:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                copies[seq.request_id] = result
        if not preempted:
            self._admit(out, self.max_num_batched_tokens - out.num_tokens)
        out.block_copies = [c for seq in out.seqs for c in copies.get(seq.request_id, ())]
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # a prompt whose log-probabilities were asked for is computed whole: cached blocks keep no logits
            cached = self.kv.find_cached_prefix(seq) if seq.params.prompt_logprobs is None else None
            num_cached_tokens = cached.num_blocks * self.kv.block_size if cached else 0
            n = self._allocate_first_chunk(seq, min(len(seq.token_ids) - num_cached_tokens, budget), cached)
            if n == 0:
                break
            self.kv.record_lookup(len(seq.token_ids), num_cached_tokens)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.admitted.append(seq)
            budget -= n

    def _allocate_first_chunk(self, seq: Sequence, n: int, cached) -> int:
        """Allocate the first chunk of `n` tokens, or 0 if the pool is short. With nothing else running (nothing to
        wait for), a smaller chunk is tried: a sliding window or an eviction policy bounds what a sequence holds
        after a step, not what one long chunk needs during it."""
        while self.kv.allocate(seq, n, cached) is None:
            if self.running or n <= self.kv.block_size:
                return 0
            n = max(self.kv.block_size, n // 2 // self.kv.block_size * self.kv.block_size)
        return n

    def _preempt(self, victim: Sequence, out: SchedulerOutput, copies: dict[str, list[BlockCopy]]) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        if victim in out.seqs:  # it was already given tokens this step: take them back
            i = out.seqs.index(victim)
            del out.seqs[i], out.num_new_tokens[i]
            copies.pop(victim.request_id, None)

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens now have K/V in the cache."""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
