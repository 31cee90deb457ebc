"""Each kind of layer group on its own: which cached blocks a prefix hit needs, which blocks it drops as the sequence
grows, how many tokens it stores; and what every group shares: copy-on-write, trimming, forking, freeing."""
import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.eviction import EvictionPolicy, H2OPolicy, StreamingPolicy
from kvserve.kv.group_managers import (EvictingManager, FullAttentionManager, SlidingWindowManager,
                                       make_group_managers)
from tests.kv.sequences import BS, Seq


def filled(manager, seq: Seq) -> None:
    """Give `seq` blocks for all its tokens and count them computed."""
    growth = manager.plan_growth(seq.request_id, 0, seq.num_computed_tokens, -(-len(seq.token_ids) // BS))
    assert manager.grow(seq.request_id, growth) == []
    seq.num_computed_tokens = len(seq.token_ids)


def test_make_group_managers_builds_one_per_group_by_kind():
    pool = BlockPool(8)
    kinds = [type(m) for m in make_group_managers(pool, BS, (None, 32, None), EvictionPolicy())]
    assert kinds == [FullAttentionManager, SlidingWindowManager, FullAttentionManager]
    streaming = StreamingPolicy(sink_tokens=4, recent_tokens=32)
    assert [type(m) for m in make_group_managers(pool, BS, (None,), streaming)] == [EvictingManager]


def test_full_attention_needs_every_cached_block_and_drops_none():
    full = FullAttentionManager(BlockPool(8), BS)
    cached = [True, True, False, True]
    assert full.first_needed(4) == 0
    assert full.hit_limit(lambda i: cached[i], 0, 4) == 2  # up to the first block missing
    assert full.hit_limit(lambda i: cached[i], 3, 4) == 4  # blocks before `start` are known held
    seq = Seq("a", list(range(70)))
    filled(full, seq)
    full.drop_unneeded(seq, None)
    assert full.table("a").logical == [0, 1, 2, 3, 4] and full.num_stored_tokens(seq) == 70


@pytest.mark.parametrize("num_blocks, first", [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2), (10, 8)])
def test_sliding_window_needs_only_the_window_before_the_hit_end(num_blocks, first):
    sliding = SlidingWindowManager(BlockPool(8), BS, window=20)  # the next query reads 20 tokens back
    assert sliding.first_needed(num_blocks) == first
    assert sliding.hit_limit(lambda i: False, 0, num_blocks) == num_blocks  # what it needs is first_needed's


def test_sliding_window_drops_what_the_window_has_passed():
    pool = BlockPool(8)
    sliding = SlidingWindowManager(pool, BS, window=20)
    seq = Seq("a", list(range(70)))
    filled(sliding, seq)
    sliding.drop_unneeded(seq, None)  # the query at 70 reads from 51: blocks 0..2 end before it
    assert sliding.table("a").logical == [3, 4]
    assert sliding.num_window_blocks_freed == 3 and sliding.num_evicted_blocks == 0
    assert pool.num_free_blocks == 6
    assert sliding.num_stored_tokens(seq) == 16 + 6


def test_tiled_windows_keep_the_window_of_the_tile_start():
    seq = Seq("a", list(range(70)))
    tiled = SlidingWindowManager(BlockPool(8), BS, window=20, tile_windows=True)
    filled(tiled, seq)
    tiled.drop_unneeded(seq, None)  # the tile from 64 reads from 45: block 2 stays
    assert tiled.table("a").logical == [2, 3, 4]


def test_eviction_keeps_sinks_and_recent_blocks_and_caps_the_exact_prefix():
    pool = BlockPool(8)
    evicting = EvictingManager(pool, BS, StreamingPolicy(sink_tokens=4, recent_tokens=20))
    seq = Seq("a", list(range(70)))
    filled(evicting, seq)
    assert evicting.exact_tokens("a") == 24  # sinks + window: later queries see a pruned context
    evicting.drop_unneeded(seq, None)
    assert evicting.table("a").logical == [0, 3, 4] and evicting.num_evicted_blocks == 2
    evicting.fork("a", "b")
    evicting.free("a")
    assert evicting.table("b").logical == [0, 3, 4] and pool.num_free_blocks == 5


def test_h2o_first_eviction_bounds_what_may_be_shared():
    evicting = EvictingManager(BlockPool(8), BS, H2OPolicy(sink_tokens=4, recent_tokens=20, budget_tokens=48))

    class Scores:
        def block_scores(self, block_ids):
            return [float(b) for b in block_ids]

    seq = Seq("a", list(range(70)))
    filled(evicting, seq)
    assert evicting.exact_tokens("a") is None
    evicting.drop_unneeded(seq, Scores())
    assert len(evicting.table("a").blocks) == 3 and evicting.exact_tokens("a") == 70
    evicting.free("a")
    assert evicting.exact_tokens("a") is None


def test_copy_on_write_trim_fork_and_free_are_every_groups():
    pool = BlockPool(8)
    full = FullAttentionManager(pool, BS)
    parent = Seq("p", list(range(20)))
    filled(full, parent)
    full.fork("p", "c")
    growth = full.plan_growth("c", 0, 20, 2)  # the child's next token goes into the shared partly filled block
    assert (growth.num_new, growth.copy_index, growth.num_blocks) == (0, 1, 1)
    shared = full.table("p").blocks[1].block_id
    [copy] = full.grow("c", growth)
    assert copy.src == shared and full.table("c").blocks[1].block_id == copy.dst != shared
    full.grow("c", full.plan_growth("c", 0, 21, 4))
    full.trim("c", BS + 5)  # the first BS + 5 tokens stay: their two blocks
    assert full.table("c").logical == [0, 1]
    full.free("p")
    full.free("c")
    assert pool.num_free_blocks == 8 and full.tables == {}
