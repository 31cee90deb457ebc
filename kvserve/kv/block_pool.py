"""The pool of physical KV blocks: free list in LRU order, reference counts, and the prefix-hash index."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.kv.block_hash import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the prefix index


class BlockPool:
    """Blocks 0..N-1. A block with ref_cnt 0 sits in the free queue; if it still has a hash it stays
    findable by prefix lookups until `allocate` hands it out again (least recently freed first)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self._freed_since_taken: list[int] = []  # blocks whose contents stopped mattering, for the storage
        self._hash_events: deque[tuple[bool, BlockHash]] | None = None  # off until someone subscribes

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request references (cached-but-unreferenced ones included, as in vLLM)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a reusable prefix."""
        return sum(1 for i in self._free if self.blocks[i].block_hash is not None)

    def free_block_ids(self) -> list[int]:
        """Unreferenced blocks in the order `allocate` hands them out: least recently freed first."""
        return list(self._free)

    def allocate(self, n: int) -> list[Block]:
        """Take `n` blocks from the front of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self._free)} free")
        taken = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found by prefix lookup (or shared by a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the queue in the order given,
        so callers pass a request's tail blocks first to have them reused before its head."""
        for block in blocks:
            if block.ref_cnt == 0:  # checked before the decrement so a caught double free leaves the pool intact
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                self._freed_since_taken.append(block.block_id)

    def take_freed(self) -> list[int]:
        """Blocks whose last reference went since the last call (a storage format may drop per-block state)."""
        freed, self._freed_since_taken = self._freed_since_taken, []
        return freed

    def subscribe_hash_events(self) -> deque[tuple[bool, BlockHash]]:
        """A queue of (True, key) when a prefix key becomes findable and (False, key) when it is evicted, starting
        with every key findable now; the subscriber pops from the left (deque ends are thread-safe)."""
        if self._hash_events is None:
            self._hash_events = deque((True, key) for key in self._cached)
        return self._hash_events

    def register(self, block: Block, block_hash: BlockHash) -> bool:
        """Make a full block findable by its prefix key (the first block with a key keeps it); True if it now is."""
        if not self.enable_prefix_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self._hash_events is not None:
            self._hash_events.append((True, block_hash))
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (a benchmark's next run starts cold). Only when no request holds a block:
        returns False and changes nothing otherwise, as vLLM's reset_prefix_cache does."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self._hash_events is not None:
                    self._hash_events.append((False, block.block_hash))
            block.block_hash = None
