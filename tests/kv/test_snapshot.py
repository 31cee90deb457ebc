"""The pool snapshot the dashboard draws: each block's state follows its reference count and prefix hash, the free
queue order is the order blocks are reused in, and the counts agree with the pool's own."""
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.kv.snapshot import snapshot_pool
from tests.kv.sequences import BS, Seq, prefill


def test_a_fresh_pool_is_all_free_in_block_order():
    snapshot = snapshot_pool(KVCacheManager(6, BS).pool)
    assert snapshot.states == "FFFFFF"
    assert snapshot.ref_cnts == [0] * 6
    assert snapshot.free_ranks == [0, 1, 2, 3, 4, 5]


def test_states_follow_references_and_prefix_hashes():
    kv = KVCacheManager(10, BS)
    system = list(range(100, 132))  # two full blocks both requests start with
    a = Seq("a", system + [7] * 20)  # 52 tokens: 4 blocks, 3 full
    b = Seq("b", system + [9] * 5)  # 37 tokens: reuses a's 2 system blocks, adds 1
    prefill(kv, a)
    prefill(kv, b)
    a_ids, b_ids = kv.block_ids("a"), kv.block_ids("b")
    assert b_ids[:2] == a_ids[:2]
    states = snapshot_pool(kv.pool).states
    assert [states[i] for i in a_ids] == ["S", "S", "U", "U"]
    assert states[b_ids[2]] == "U"
    assert states.count("F") == 10 - 5

    kv.free(a)  # a's own blocks are dropped; its third (full) block stays findable, its partial tail does not
    snapshot = snapshot_pool(kv.pool)
    assert [snapshot.states[i] for i in a_ids] == ["U", "U", "C", "F"]
    assert [snapshot.ref_cnts[i] for i in a_ids] == [1, 1, 0, 0]
    assert snapshot.count("cached") == kv.pool.num_cached_blocks == 1
    assert snapshot.count("in_use") + snapshot.count("shared") == kv.pool.num_used_blocks == 3
    assert snapshot.count("free") + snapshot.count("cached") == kv.pool.num_free_blocks


def test_free_ranks_give_the_order_blocks_are_reused_in():
    kv = KVCacheManager(6, BS)
    seq = Seq("a", list(range(100, 148)))  # three full blocks
    prefill(kv, seq)
    kv.free(seq)  # tail first: the head is reused last
    snapshot = snapshot_pool(kv.pool)
    by_rank = sorted((rank, block_id) for block_id, rank in enumerate(snapshot.free_ranks) if rank >= 0)
    reuse_order = [block.block_id for block in kv.pool.allocate(6)]
    assert [block_id for _, block_id in by_rank] == reuse_order
    assert snapshot.states == "CCCFFF"  # held: none; the request's three full blocks still cached
    assert snapshot_pool(kv.pool).free_ranks == [-1] * 6  # all taken now

