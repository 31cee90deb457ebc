"""The state cache of hybrid models' linear-attention layers (Gated DeltaNet): a pool of fixed slots beside the paged
KV, one slot per running sequence, each holding every linear layer's conv tail and recurrent state in float32.

Three objects with one job each: StateCache holds the bytes, StateSlots (held by the KV cache coordinator) says
which sequence owns which slot — taken at admission, freed when the sequence finishes, is aborted or preempted
(a preempted sequence is recomputed from its first token), copied for a fork (n > 1, beams) — and StateStep tells a
step's linear layers where each sequence's tokens and slot are."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.kv.draft_states import DraftStates
from kvserve.kv.formats.compiled import CompiledFunction

STATE_DTYPE = torch.float32
STATE_DTYPE_BYTES = 4
# prompt pieces computed in one call hold at most this much recurrent state per layer: the chunked rule reads each
# state several times, and a batch that outgrows the CPU's L2 cache reads it from memory each time, slower than a
# few sequences at a time (`python -m kvserve.bench.delta_rule`, "prompt batching"); small states batch freely
PROMPT_BATCH_STATE_BYTES = 2 << 20


@dataclass(frozen=True)
class StateShape:
    """One slot's tensors per linear layer: the conv tail [kernel - 1, conv_dim] (the inputs before the next token,
    oldest first) and the recurrent state [value_heads, value_head_dim, key_head_dim] (each row a value dim's
    weights over the keys: S transposed, so that a decode token's reads and update of a row need only that row)."""

    num_layers: int
    conv_dim: int
    conv_tail: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over every linear layer."""
        per_layer = self.conv_dim * self.conv_tail + self.num_value_heads * self.key_head_dim * self.value_head_dim
        return self.num_layers * per_layer * STATE_DTYPE_BYTES

    def describe(self) -> str:
        """The slots' layout, for the disk tier's fingerprint: records of another layout are not read."""
        return "conv tail [kernel - 1, conv_dim]; recurrent state [value heads, value dim, key dim]; float32"


def delta_rule_step_(states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token of the gated delta rule (model/gated_delta.py) over N recurrent states in the state cache's
    layout, in place: states [N, Dv, Dk] float32 and contiguous, q and k [N, Dk], v [N, Dv], decay (exp(g)) and
    beta [N]. Returns S q of the states before the token and u = beta (v - decay S k), [N, Dv] each; the states
    become decay S + u k^T. Two passes: a batched matmul reads the states (as [q k]^T S^T, which the BLAS runs
    faster than S [q k]), then the decay and the rank-one update."""
    read_q, read_k = torch.bmm(torch.stack([q, k], dim=1), states.transpose(1, 2)).unbind(1)
    u = (v - decay[:, None] * read_k).mul_(beta[:, None])
    states.mul_(decay[:, None, None]).baddbmm_(u[:, :, None], k[:, None, :])
    return read_q, u


def delta_rule_step_in_one_pass(states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                decay: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_step_ as broadcast products and sums, which torch.compile makes one loop that reads each state row
    once and writes it once: a row's reads are sums over its keys, and its update needs only them (the layout's
    point). Returns S q and S k: u as an output would be a buffer between the sums and the update, splitting the
    loop in two (StateCache.delta_rule_step makes u from S k)."""
    read_k = (states * k[:, None, :]).sum(-1)
    read_q = (states * q[:, None, :]).sum(-1)
    u = beta[:, None] * (v - decay[:, None] * read_k)
    states.copy_(states * decay[:, None, None] + u[:, :, None] * k[:, None, :])
    return read_q, read_k


class StateCache:
    """The slots' storage: conv[layer][slot] and recurrent[layer][slot] (StateShape's layout), float32, zero at
    start. A decode token reads and updates many MiB of recurrent state per sequence: with `compile_update` that is
    one compiled loop (compiled or loaded at warm_up, as the KV formats' decode kernels: kv/formats/compiled.py),
    otherwise a batched matmul and an update in place (delta_rule_step_)."""

    def __init__(self, shape: StateShape, num_slots: int, device: str | torch.device = "cpu",
                 compile_update: bool = False):
        self.shape = shape
        self.num_slots = num_slots
        s = shape
        self.conv = torch.zeros(s.num_layers, num_slots, s.conv_tail, s.conv_dim, dtype=STATE_DTYPE, device=device)
        self.recurrent = torch.zeros(s.num_layers, num_slots, s.num_value_heads, s.value_head_dim, s.key_head_dim,
                                     dtype=STATE_DTYPE, device=device)
        self.compiled_update = CompiledFunction(delta_rule_step_in_one_pass) if compile_update else None

    def delta_rule_step(self, states: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        decay: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """delta_rule_step_ over `states` (a decode step's, read from this cache): compiled where it was warmed up,
        eagerly otherwise (a call no graph takes, or a failed compile: CompiledFunction says so once)."""
        args = (states, q, k, v, decay, beta)
        if self.compiled_update is not None:
            reads = self.compiled_update(args)
            if reads is not None:
                read_q, read_k = reads
                return read_q, (v - decay[:, None] * read_k).mul_(beta[:, None])
        return delta_rule_step_(*args)

    def warm_up(self) -> None:
        """Compile (or load) the compiled step for the calls decode steps make, inside inference mode: over a view
        of the pool (decoding slots that form one run) and over a copy of some of its slots (others); the number
        of states is dynamic, one graph each for every batch."""
        if self.compiled_update is None:
            return
        s = self.shape
        scratch = torch.zeros(2, s.num_value_heads, s.value_head_dim, s.key_head_dim, dtype=STATE_DTYPE,
                              device=self.recurrent.device)  # made as the pool is: outside inference mode
        with torch.inference_mode(), self.compiled_update.warming_up():
            for states in (scratch, scratch.clone()):  # the pool's view, then a copy made in inference mode
                flat = states.view(-1, s.value_head_dim, s.key_head_dim)
                n = flat.shape[0]
                args = (flat, flat.new_zeros(n, s.key_head_dim), flat.new_zeros(n, s.key_head_dim),
                        flat.new_zeros(n, s.value_head_dim), flat.new_ones(n), flat.new_zeros(n))
                self.compiled_update(args, dynamic=[(a, 0) for a in args])

    def update_kind(self) -> str:
        """How the decode step runs, for the start-up line."""
        return "eager" if self.compiled_update is None or self.compiled_update.failed else "compiled"

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def slot_specs(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Dtype and shape of a slot's tensors, every layer: its conv tails, then its recurrent states."""
        return [(self.conv.dtype, (self.conv.shape[0], *self.conv.shape[2:])),
                (self.recurrent.dtype, (self.recurrent.shape[0], *self.recurrent.shape[2:]))]

    def export_slot(self, slot: int) -> list[torch.Tensor]:
        """A copy of one slot's tensors on the CPU (slot_specs' order), e.g. for the disk tier."""
        return [self.conv[:, slot].to("cpu", copy=True), self.recurrent[:, slot].to("cpu", copy=True)]

    def import_slot(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Fill one slot from export_slot's tensors."""
        self.conv[:, slot] = tensors[0].to(self.conv.device)
        self.recurrent[:, slot] = tensors[1].to(self.recurrent.device)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) slot's states, every layer (a forked sequence's)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.conv.device)
        dst = torch.tensor([d for _, d in copies], device=self.conv.device)
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]


@dataclass(frozen=True)
class SlotBatch:
    """Sequences' state slots in ascending order. Slots that form one run (first, first + 1, ...) are read and written
    in place through a view of the pool; others through index_select and index_copy_."""

    slots: torch.Tensor  # [B] ascending
    first: int | None  # the run's first slot, None if the slots are not one run

    @classmethod
    def of(cls, slots: list[int], device: str | torch.device) -> SlotBatch:
        """`slots` ascending and distinct."""
        run = bool(slots) and slots[-1] - slots[0] + 1 == len(slots)
        return cls(torch.tensor(slots, dtype=torch.long, device=device), slots[0] if run else None)

    def __len__(self) -> int:
        return len(self.slots)

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        """These slots of one layer's pool [slots, ...]: a view of it when they are one run, else a copy."""
        if self.first is None:
            return pool.index_select(0, self.slots)
        return pool[self.first : self.first + len(self.slots)]

    def write(self, pool: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values` into these slots (nothing to copy when `values` is read's view, updated in place)."""
        if self.first is None:
            pool.index_copy_(0, self.slots, values)
        elif values.data_ptr() != pool[self.first].data_ptr():
            pool[self.first : self.first + len(self.slots)].copy_(values)


@dataclass(frozen=True)
class PromptRound:
    """Prompt pieces the linear layers compute in one call, at most one per sequence, in slot order: each padded
    to the longest (padding repeats the piece's last row), the state saved into checkpoints after them."""

    slots: SlotBatch
    rows: torch.Tensor  # [B, L] rows of the step's flat batch
    lengths: torch.Tensor  # [B] real tokens of each piece
    fresh: torch.Tensor  # [B, 1, 1] bool: the piece starts its sequence (from zero states)
    real: torch.Tensor  # [B, L] bool: rows that are not padding
    checkpoints: list[tuple[int, int]]  # (slot, checkpoint slot): saved after the round
    all_fresh: bool = False  # every piece starts its sequence: no state to read


def prompt_rounds(chunks: list[tuple[slice, int, bool, list[tuple[int, int]]]], max_batch: int,
                  device: str | torch.device) -> list[PromptRound]:
    """Cut each prompt chunk at its checkpoints into pieces, and put every sequence's i-th piece in round i, in
    calls of at most `max_batch` pieces."""
    rounds: list[list[tuple[int, int, int, bool, int | None]]] = []  # (slot, start row, end row, fresh, checkpoint)
    for rows, slot, fresh, checkpoints in chunks:
        cuts = [(rows.start + n, checkpoint) for n, checkpoint in checkpoints] + [(rows.stop, None)]
        start = rows.start
        for i, (end, checkpoint) in enumerate(cuts):
            if i == len(rounds):
                rounds.append([])
            rounds[i].append((slot, start, end, fresh and start == rows.start, checkpoint))
            start = end
    return [_round(pieces[i : i + max_batch], device) for pieces in map(sorted, rounds)
            for i in range(0, len(pieces), max_batch)]


def _round(pieces: list[tuple[int, int, int, bool, int | None]], device: str | torch.device) -> PromptRound:
    computed = [p for p in pieces if p[2] > p[1]]  # a checkpoint at a piece's start computes nothing before it
    width = max((end - start for _, start, end, _, _ in computed), default=0)
    steps = torch.arange(width)
    starts, ends = (torch.tensor([p[i] for p in computed], dtype=torch.long).view(-1, 1) for i in (1, 2))
    rows = torch.minimum(starts + steps, ends - 1)
    return PromptRound(SlotBatch.of([p[0] for p in computed], device), rows.to(device),
                       (ends - starts).view(-1).to(device),
                       torch.tensor([p[3] for p in computed], dtype=torch.bool, device=device).view(-1, 1, 1),
                       (starts + steps < ends).to(device),
                       [(p[0], p[4]) for p in pieces if p[4] is not None], all(p[3] for p in computed))


@dataclass
class StateStep:
    """One step's sequences as the linear layers see them: decodes (one token continuing a state) in one batch,
    prompt chunks in rounds of pieces batched across sequences, each with its slot; a chunk that starts its
    sequence (fresh) starts from zeros."""

    cache: StateCache
    decode_rows: torch.Tensor  # [D] rows of the flat batch that are decodes, in slot order
    decodes: SlotBatch  # their slots
    # (rows, slot, fresh, checkpoint): checkpoint (n, slot) saves the state after the chunk's first n tokens
    prompt_chunks: list[tuple[slice, int, bool, list[tuple[int, int]]]] = field(default_factory=list)
    decode_checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (slot, checkpoint slot) after the step
    drafts: DraftStates | None = None  # speculative decoding: drafted sequences, verified one token at a time

    @classmethod
    def of(cls, cache: StateCache, decode_rows: list[int], decode_slots: list[int], device: str | torch.device,
           prompt_chunks: list | None = None, decode_checkpoints: list | None = None,
           drafts: DraftStates | None = None) -> StateStep:
        """A step whose decodes are in `decode_rows` of the flat batch, with their slots (any order)."""
        order = sorted(range(len(decode_slots)), key=decode_slots.__getitem__)
        rows = torch.tensor([decode_rows[i] for i in order], dtype=torch.long, device=device)
        return cls(cache, rows, SlotBatch.of([decode_slots[i] for i in order], device), prompt_chunks or [],
                   decode_checkpoints or [], drafts)

    @functools.cached_property
    def prompt_rounds(self) -> list[PromptRound]:
        """prompt_chunks as rounds (every layer reads them; planned once), each call's states within
        PROMPT_BATCH_STATE_BYTES."""
        s = self.cache.shape
        per_sequence = s.num_value_heads * s.key_head_dim * s.value_head_dim * STATE_DTYPE_BYTES
        return prompt_rounds(self.prompt_chunks, max(1, PROMPT_BATCH_STATE_BYTES // per_sequence),
                             self.cache.conv.device)

    def save(self, layer: int, slot: int, checkpoint: int) -> None:
        """Copy one layer's state of `slot` into checkpoint slot `checkpoint`."""
        self.cache.conv[layer, checkpoint] = self.cache.conv[layer, slot]
        self.cache.recurrent[layer, checkpoint] = self.cache.recurrent[layer, slot]


class StateSlots:
    """Which sequence holds which of `num_slots` state slots; forks and checkpoint restores queue a copy the runner
    makes before the next forward pass (take_copies)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._slot_of: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def can_take(self, request_id: str) -> bool:
        """Whether `request_id` holds a slot or one is free for it."""
        return request_id in self._slot_of or bool(self._free)

    def take(self, request_id: str) -> int:
        """The request's slot, taking a free one on its first call (can_take must hold)."""
        if request_id not in self._slot_of:
            self._slot_of[request_id] = self._free.pop()
        return self._slot_of[request_id]

    def restore(self, request_id: str, checkpoint_slot: int) -> None:
        """The request's slot starts from a checkpoint's state (a prefix hit)."""
        self._copies.append((checkpoint_slot, self.take(request_id)))

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child takes a slot and gets a copy of the parent's states before the next step."""
        if not self._free:
            raise ValueError(f"no free state slot to fork {parent_id!r} into {child_id!r} (all {self.num_slots} "
                             "slots are held; each running sequence holds one: raise max_num_seqs' slots)")
        self._copies.append((self._slot_of[parent_id], self.take(child_id)))

    def free(self, request_id: str) -> None:
        """Give the request's slot back (nothing if it holds none); a copy still queued into it is dropped."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._copies = [(s, d) for s, d in self._copies if d != slot]
            self._free.append(slot)

    def copies_from(self, slot: int) -> bool:
        """Whether a queued copy still reads `slot` (a checkpoint being restored: it must not be overwritten)."""
        return any(src == slot for src, _ in self._copies)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies


@dataclass
class _Checkpoint:
    slot: int
    num_blocks: int  # its depth: the blocks a hit on it skips
    value: float
    hits: int = 0
    filled: bool = False  # its block is registered, so the step that saves its state has run


class StateCheckpoints:
    """States saved at block boundaries, so that a prefix hit resumes: `num_slots` slots of the state cache from
    `first_slot` on, each holding the state after the block whose chained hash is its key.

    Evicted by value, not by age alone (GreedyDual-Size-Frequency): a checkpoint's value is the clock plus
    (hits + 1) × its depth in blocks, the prefill a hit on it saves, set when it is saved (a branch point counting
    the miss that found it as a hit) and again at each hit; when no slot is free the lowest value goes and the clock
    rises to it, so one not hit for a while falls behind newer ones. First of all goes any whose block the pool no
    longer holds (`held` false): no hit can use it (a hit needs its whole KV prefix). A checkpoint whose block is not
    registered yet (its step has not run), or that a queued copy still reads (`copied`: an admission restores it), is
    never taken."""

    def __init__(self, first_slot: int, num_slots: int, held: Callable[[bytes], bool] = lambda key: True,
                 copied: Callable[[int], bool] = lambda slot: False):
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._saved: dict[bytes, _Checkpoint] = {}
        self._key_of: dict[int, bytes] = {}  # slot -> key
        self._held = held  # whether the pool still holds the block a checkpoint ends
        self._copied = copied  # whether a queued copy still reads a slot
        self._clock = 0.0
        self.num_slots = num_slots
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._saved)

    @property
    def num_waiting(self) -> int:
        """Checkpoints whose block is not registered yet (their step has not run)."""
        return sum(not c.filled for c in self._saved.values())

    def lookup(self, key: bytes) -> int | None:
        """The checkpoint slot saved under `key`; None if there is none."""
        checkpoint = self._saved.get(key)
        return checkpoint.slot if checkpoint is not None else None

    def contains(self, key: bytes) -> bool:
        return key in self._saved

    def saved_slot(self, key: bytes) -> int | None:
        """The slot holding the state saved under `key`, once its step has run (filled); None otherwise."""
        checkpoint = self._saved.get(key)
        return checkpoint.slot if checkpoint is not None and checkpoint.filled else None

    def take(self, key: bytes, num_blocks: int, hits: int = 0) -> int | None:
        """A slot to save the state after `key`'s block (the `num_blocks`-th) in, the least valuable one's if none
        is free; None if every slot waits for its step. `hits`: those it starts with (a branch point, where a
        prompt found the blocks but no state, counts the one it missed)."""
        if not self._free:
            victim = self.victim()
            if victim is None:
                return None
            self._clock = max(self._clock, self._saved[victim].value)
            self.release(victim)
        slot = self._free.pop()
        self._saved[key] = _Checkpoint(slot, num_blocks, self._clock + (hits + 1) * num_blocks, hits)
        self._key_of[slot] = key
        return slot

    def victim(self) -> bytes | None:
        """The checkpoint `take` gives up next: one whose block the pool lost, else the lowest value."""
        candidates = [(self._held(key), c.value, age, key) for age, (key, c) in enumerate(self._saved.items())
                      if c.filled and not self._copied(c.slot)]  # equal values: the oldest saved goes
        return min(candidates)[3] if candidates else None

    def filled(self, key: bytes) -> None:
        """`key`'s block is registered: its state is saved, and the checkpoint may be evicted from now on."""
        if key in self._saved:
            self._saved[key].filled = True

    def hit(self, slot: int) -> None:
        """An admission resumes from the checkpoint in `slot`."""
        checkpoint = self._saved[self._key_of[slot]]
        checkpoint.hits += 1
        checkpoint.value = self._clock + (checkpoint.hits + 1) * checkpoint.num_blocks
        self.num_hits += 1

    def release(self, key: bytes) -> None:
        checkpoint = self._saved.pop(key, None)
        if checkpoint is not None:
            del self._key_of[checkpoint.slot]
            self._free.append(checkpoint.slot)
