"""Continuous batching: which sequences run this step, with how many tokens each, within the token, block and
sequence budgets.

Every sequence holds one of `max_num_seqs` slots, each sample of an n>1 request included. Sequences are ranked
(`Sequence.rank`): every request's first sample before any request's second sample, and so on; among equals, the
request that came first. Running sequences go first (decodes before unfinished prefills, so a long prompt never
starves them); when one needs a block and none is free, the lowest-ranked running sequence is preempted: its
blocks are freed and it waits to be recomputed. Waiting sequences are admitted in rank order while blocks, slots
and tokens allow, and a request's first sample may take the slot and blocks of a running later sample, so a new
request never waits behind another request's samples 2..n, however much they churn."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.engine.speculative import Speculator
from kvserve.kv.kv_cache_manager import BlockCopy, KVCacheManager


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # parallel to seqs
    block_copies: list[BlockCopy] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # first scheduled this step (some from preemption)
    # speculative decoding: draft tokens each drafted sequence verifies after its last token, by request id (its
    # num_new_tokens counts them; its computed tokens advance only by the accepted ones, after sampling)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 speculator: Speculator | None = None):
        self.kv = kv
        self.speculator = speculator  # proposes draft tokens for decoding sequences (engine/speculative.py)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # by rank, the next to admit first
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._num_arrivals = 0

    def add(self, seq: Sequence) -> None:
        """A new request's first sequence."""
        seq.arrival = self._num_arrivals
        self._num_arrivals += 1
        self._wait(seq)

    def add_sibling(self, seq: Sequence, of: Sequence) -> None:
        """A later sample of `of`'s request that found no free slot: it waits, ranked by its own index."""
        seq.arrival = of.arrival
        self._wait(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A forked sibling starts out running (in a slot free_slots counted), right after the sequence it shares
        blocks with."""
        seq.status = SequenceStatus.RUNNING
        seq.arrival = after.arrival
        self.running.insert(self.running.index(after) + 1, seq)

    def _wait(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.rank)

    @property
    def free_slots(self) -> int:
        return self.max_num_seqs - len(self.running)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences not running yet: waiting ones, plus the samples an n>1 request has still to fork."""
        unforked = sum(s.params.n - 1 for s in self.waiting + self.running if s.params.n > 1 and not s.forked)
        return len(self.waiting) + unforked

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, int]:
        return {"num_running": len(self.running), "num_waiting": self.num_waiting_seqs,
                "num_preemptions": self.num_preemptions}

    def schedule(self) -> SchedulerOutput:
        self.kv.collect_loads()  # prefixes read from disk since the last step join the prefix index
        out = SchedulerOutput()
        copies: dict[str, list[BlockCopy]] = {}
        preempted: list[Sequence] = []
        num_decoding = sum(_decoding(s) for s in self.running)
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.rank)):
            budget = self.max_num_batched_tokens - out.num_tokens
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            draft = (self.speculator.propose(seq, budget - 1, num_decoding)
                     if self.speculator is not None and _decoding(seq) else [])
            while (result := self.kv.allocate(seq, n + len(draft))) is None:
                if draft:  # short of blocks: verify nothing rather than preempt anyone
                    draft = []
                    continue
                victim = max(self.running, key=lambda s: s.rank)
                self._preempt(victim, out, copies)
                preempted.append(victim)
                if victim is seq:
                    break
            if result is not None:
                out.seqs.append(seq)
                out.num_new_tokens.append(n + len(draft))
                copies[seq.request_id] = result
                if draft:
                    out.drafts[seq.request_id] = draft
        # A sequence preempted for blocks would only push out another if admitted now: admit only those above it.
        self._admit(out, copies, min((s.rank for s in preempted), default=None))
        out.block_copies = [c for seq in out.seqs for c in copies.get(seq.request_id, ())]
        return out

    def _admit(self, out: SchedulerOutput, copies: dict[str, list[BlockCopy]], below: tuple[int, int] | None) -> None:
        for seq in list(self.waiting):  # a copy: those it preempts rank below it and wait for the next step
            if below is not None and seq.rank >= below:
                return
            if seq.params.prompt_logprobs is None and self.kv.prefix_loading(seq):
                continue  # its prefix is being read from disk: the others go on meanwhile
            if not self.free_slots and not self._preempt_for(seq, out, copies):
                return
            while (budget := self.max_num_batched_tokens - out.num_tokens) <= 0:  # later samples' recompute took it
                if not self._preempt_for(seq, out, copies):
                    return
            # a prompt whose log-probabilities were asked for is computed whole: cached blocks keep no logits
            cached = self.kv.find_cached_prefix(seq) if seq.params.prompt_logprobs is None else None
            num_cached_tokens = cached.num_blocks * self.kv.block_size if cached else 0
            num_tokens = min(len(seq.token_ids) - num_cached_tokens, budget)
            while (n := self._allocate_first_chunk(seq, num_tokens, cached)) == 0:
                if not self._preempt_for(seq, out, copies):
                    return
            self.kv.record_lookup(len(seq.token_ids), num_cached_tokens)
            self.waiting.remove(seq)
            seq.num_computed_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            out.admitted.append(seq)

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput, copies: dict[str, list[BlockCopy]]) -> bool:
        """Make room for a request's waiting first sample by preempting the lowest-ranked running later sample;
        False if there is none, or `seq` is a later sample itself (then it waits for room)."""
        victim = max(self.running, key=lambda s: s.rank, default=None)
        if seq.index > 0 or victim is None or victim.index == 0:
            return False
        self._preempt(victim, out, copies)
        return True

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
        self._wait(victim)
        if victim in out.seqs:  # it was already given tokens this step: take them back
            i = out.seqs.index(victim)
            del out.seqs[i], out.num_new_tokens[i]
            copies.pop(victim.request_id, None)
            out.drafts.pop(victim.request_id, None)
            if victim in out.admitted:
                out.admitted.remove(victim)

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens now have K/V in the cache (a drafted sequence's, once its
        draft is verified: `accept`)."""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.request_id not in out.drafts:
                seq.num_computed_tokens += n
                self.kv.cache_full_blocks(seq)

    def accept(self, seq: Sequence, num_computed_tokens: int) -> None:
        """After verifying a draft: the sequence's K/V is valid for its first `num_computed_tokens` tokens (its last
        token and the accepted drafts); the blocks only rejected drafts were written to go back to the pool."""
        seq.num_computed_tokens = num_computed_tokens
        self.kv.trim(seq)
        self.kv.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and give its blocks back."""
        if self.speculator is not None:
            self.speculator.finish(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)


def _decoding(seq: Sequence) -> bool:
    """A running sequence whose next step computes its newest sampled token alone (what a draft can follow)."""
    return seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
