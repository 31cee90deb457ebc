"""What the KV cache manager sees of a tier below the pool: a leaf module, so that the manager and the tiers import
it and never each other. The manager hands a tier the blocks it registers (`save`), asks it for the keys the pool
lacks (`contains`, `worth_reading`), reads a prefix's blocks back into pool blocks (`start_reading`) and counts the
tokens a tier supplied (`count_hit_tokens`). A hybrid model's manager also hands it state checkpoints with their
blocks (`save_state`), asks for them (`contains_state`) and reads the deepest usable one with a prefix's blocks."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.kv.block_hash import BlockHash


@dataclass(frozen=True)
class BlockLoad:
    """Read one block from a lower tier into a pool block: the record's key, and the parent key and token ids the
    record must carry."""

    block_id: int
    key: BlockHash
    parent: BlockHash | None
    token_ids: Sequence[int]


@dataclass(frozen=True)
class StateLoad:
    """A state checkpoint a prefix read may end with: the state after the block of `key` (its parent key and token
    ids, checked as a block's), usable once the read's first `num_loads` blocks are in; `held`: the manager holds it
    already (no read), so no shallower one is read."""

    key: BlockHash
    parent: BlockHash | None
    token_ids: Sequence[int]
    num_loads: int
    held: bool = False


class TierRead(Protocol):
    """A prefix's blocks (and the deepest usable state checkpoint, if asked for) being read from a tier while the
    engine's steps go on."""

    loads: list[BlockLoad]
    state: StateLoad | None  # after finish: the checkpoint read, usable with the blocks read (put_state)

    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> None: ...

    def finish(self) -> int:
        """Put the blocks read into their pool blocks, in order up to the first miss (once done); returns how many."""
        ...

    def put_state(self, slot: int) -> None:
        """Put the state checkpoint read (`state`) into state slot `slot`."""
        ...


class KVTier(Protocol):
    """A tier below the pool, as the KV cache manager calls it."""

    def attach_pool(self, find_block: Callable[[BlockHash], int | None]) -> None:
        """Called once by the manager: `find_block` says which pool block holds a key now (None: none)."""
        ...

    def attach_checkpoints(self, find_slot: Callable[[BlockHash], int | None]) -> None:
        """Called once for hybrid models: `find_slot` says which state slot holds the checkpoint saved under a key
        now (None: none)."""
        ...

    def contains(self, key: BlockHash) -> bool: ...

    def worth_reading(self, num_records: int, num_tokens: int, num_states: int = 0) -> bool:
        """Whether reading `num_records` blocks (and `num_states` state checkpoints) beats prefilling the
        `num_tokens` they save."""
        ...

    def start_reading(self, loads: Sequence[BlockLoad], states: Sequence[StateLoad] = ()) -> TierRead:
        """Read `loads` in order up to the first miss, then the first of `states` (deepest first) usable with the
        blocks read: one `held` ends the search, one on the tier is read and checked."""
        ...

    def save(self, block_id: int, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Keep a newly registered full pool block, with its parent key and tokens for a reader to check."""
        ...

    def save_state(self, slot: int, key: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Keep the state checkpoint in state slot `slot`: the state after the block of `key` (parent, tokens)."""
        ...

    def contains_state(self, key: BlockHash) -> bool: ...

    def count_hit_tokens(self, num_tokens: int) -> None:
        """Prompt tokens whose blocks this tier supplied (the manager knows which tokens an admission used)."""
        ...

    def stats(self) -> dict[str, float | int]: ...
