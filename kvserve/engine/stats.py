"""The KV cache manager's pieces of the engine's stats: its pool, the tokens the live sequences store, the blocks
eviction and sliding windows freed, and prefix-cache lookups. Each piece is a dict in the order the engine's
`stats()` lists it."""
from __future__ import annotations

from kvserve.engine.sequence import Sequence
from kvserve.kv.kv_cache_manager import KVCacheManager


def sliding_window_stats(kv: KVCacheManager, live: list[Sequence], windows: tuple) -> dict[str, int]:
    """The tokens the first sliding layer group stores (it holds only its window's); empty without one."""
    sliding_group = next((g for g, w in enumerate(windows) if w is not None), None)
    if sliding_group is None:
        return {}
    return {"num_tokens_stored_sliding": sum(kv.num_stored_tokens(s, sliding_group) for s in live)}


def pool_stats(kv: KVCacheManager, live: list[Sequence], windows: tuple) -> dict[str, float | int]:
    """The block pool's counts and the tokens the live sequences store in a full-attention group."""
    pool = kv.pool
    full_group = windows.index(None) if None in windows else 0  # whose tokens "num_tokens_stored" counts
    return {
        "num_blocks": pool.num_blocks,
        "block_size": kv.block_size,
        "num_free_blocks": pool.num_free_blocks,
        "num_used_blocks": pool.num_used_blocks,
        "num_cached_blocks": pool.num_cached_blocks,
        "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
        "num_tokens_stored": sum(kv.num_stored_tokens(s, full_group) for s in live),
        "slot_waste_tokens": sum(kv.num_wasted_slots(s) for s in live),
    }


def freed_block_stats(kv: KVCacheManager) -> dict[str, int]:
    """Blocks an eviction policy and sliding windows gave back while their sequences ran."""
    return {"num_evicted_blocks": kv.num_evicted_blocks, "num_window_blocks_freed": kv.num_window_blocks_freed}


def prefix_cache_stats(kv: KVCacheManager) -> dict[str, float | int]:
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }


def state_stats(kv: KVCacheManager) -> dict[str, int]:
    """A hybrid model's state slots (one per running sequence) and checkpoints (states saved at block boundaries)
    with the admissions that resumed from one; empty for a model without a state cache."""
    if kv.state is None:
        return {}
    checkpoints = kv.checkpoints
    return {
        "num_state_slots": kv.state.num_slots,
        "num_free_state_slots": kv.state.num_free_slots,
        "num_state_checkpoint_slots": checkpoints.num_slots if checkpoints is not None else 0,
        "num_state_checkpoints": len(checkpoints) if checkpoints is not None else 0,
        "state_checkpoint_hits": checkpoints.num_hits if checkpoints is not None else 0,
    }
