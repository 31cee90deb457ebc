"""Block tables per request: prefill and decode take exactly the blocks their tokens need, a short pool changes
nothing, forks share blocks until copy-on-write, freeing gives everything back, and prefix-cache lookups reuse
whole computed blocks (never the last prompt token) only under the same cache salt; with several layer groups each
keeps what its kind needs, and the drop counters add up over them."""
import pytest

from kvserve.kv.eviction import StreamingPolicy
from kvserve.kv.kv_cache_manager import BlockCopy, KVCacheManager
from tests.kv.sequences import BS, Seq, prefill


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def ref_counts(kv: KVCacheManager, seq: Seq) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in kv.block_ids(seq.request_id)]


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (15, 1), (16, 1), (17, 2), (33, 3), (64, 4)])
def test_prefill_allocates_ceil_tokens_over_block_size(num_tokens, num_blocks):
    kv = KVCacheManager(8, BS)
    seq = Seq("a", prompt(num_tokens))
    assert kv.allocate(seq, num_tokens) == []
    assert len(kv.block_ids("a")) == num_blocks
    assert kv.num_allocated_slots("a") == num_blocks * BS
    assert kv.pool.num_free_blocks == 8 - num_blocks


def test_decode_grows_by_one_block_only_when_the_last_is_full():
    kv = KVCacheManager(8, BS)
    seq = Seq("a", prompt(30))
    kv.allocate(seq, 30)
    seq.num_computed_tokens = 30
    grown_at = []
    for _ in range(40):
        seq.token_ids.append(7)
        before = len(kv.block_ids("a"))
        assert kv.allocate(seq, 1) == []
        if len(kv.block_ids("a")) != before:
            assert len(kv.block_ids("a")) == before + 1
            grown_at.append(seq.num_computed_tokens)  # position of the token that needed the new block
        seq.num_computed_tokens += 1
    assert grown_at == [32, 48, 64]


def test_short_pool_returns_none_and_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = Seq("a", prompt(48))
    kv.allocate(a, 48)
    a.num_computed_tokens = 48
    b = Seq("b", prompt(20, start=500))
    assert kv.allocate(b, 20) is None  # needs 2 blocks, 1 free
    assert kv.block_ids("b") == [] and kv.pool.num_free_blocks == 1

    kv.allocate(Seq("c", prompt(3)), 3)  # takes the last block
    a.token_ids.append(1)
    table = kv.block_ids("a")
    assert kv.allocate(a, 1) is None  # a decode that needs a 5th block
    assert kv.block_ids("a") == table and kv.pool.num_free_blocks == 0


def test_fork_shares_every_block():
    kv = KVCacheManager(8, BS)
    parent, child = Seq("p", prompt(40)), Seq("p#1", prompt(40))
    prefill(kv, parent)
    kv.fork(parent, child)
    assert kv.block_ids("p#1") == kv.block_ids("p")
    assert ref_counts(kv, parent) == [2, 2, 2]
    assert kv.pool.num_free_blocks == 5
    kv.free(parent)
    assert ref_counts(kv, child) == [1, 1, 1] and kv.pool.num_free_blocks == 5
    kv.free(child)
    assert kv.pool.num_free_blocks == 8


def test_first_write_into_a_shared_partial_block_copies_it():
    kv = KVCacheManager(8, BS)
    parent, child = Seq("p", prompt(20)), Seq("p#1", prompt(20))
    prefill(kv, parent)
    kv.fork(parent, child)
    child.num_computed_tokens = 20
    shared = kv.block_ids("p")

    child.token_ids.append(5)
    copies = kv.allocate(child, 1)
    new_block = kv.block_ids("p#1")[1]
    assert copies == [BlockCopy(src=shared[1], dst=new_block)]
    assert new_block not in shared
    assert kv.block_ids("p#1") == [shared[0], new_block]
    assert ref_counts(kv, parent) == [2, 1]  # the full first block stays shared

    parent.token_ids.append(6)
    assert kv.allocate(parent, 1) == []  # now the only owner: writes in place
    assert kv.block_ids("p") == shared


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(8, BS)
    parent, child = Seq("p", prompt(32)), Seq("p#1", prompt(32))
    prefill(kv, parent)
    kv.fork(parent, child)
    child.num_computed_tokens = 32
    child.token_ids.append(5)
    assert kv.allocate(child, 1) == []
    assert kv.block_ids("p#1")[:2] == kv.block_ids("p")
    assert ref_counts(kv, parent) == [2, 2]


def test_copy_on_write_with_no_free_block_changes_nothing():
    kv = KVCacheManager(2, BS)
    parent, child = Seq("p", prompt(20)), Seq("p#1", prompt(20))
    prefill(kv, parent)
    kv.fork(parent, child)
    child.num_computed_tokens = 20
    child.token_ids.append(5)
    assert kv.allocate(child, 1) is None
    assert kv.block_ids("p#1") == kv.block_ids("p") and ref_counts(kv, parent) == [2, 2]


def test_free_returns_every_block_tail_first():
    kv = KVCacheManager(5, BS)
    a, b = Seq("a", prompt(40)), Seq("b", prompt(20, start=900))
    prefill(kv, a)
    prefill(kv, b)
    kv.fork(b, Seq("b#1"))
    head, middle, tail = kv.block_ids("a")
    kv.free(a)
    kv.free(b)
    kv.free(Seq("b#1"))
    assert kv.pool.num_free_blocks == 5
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
    assert kv.block_ids("a") == [] and kv.num_allocated_slots("a") == 0
    reuse_order = [block.block_id for block in kv.pool.allocate(5)]
    assert reuse_order.index(tail) < reuse_order.index(middle) < reuse_order.index(head)


def test_cached_prefix_reuses_computed_full_blocks():
    kv = KVCacheManager(8, BS)
    a = Seq("a", prompt(40))
    prefill(kv, a)
    b = Seq("b", prompt(40) + [1, 2, 3])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits.blocks[0]] == kv.block_ids("a")[:2]  # the partial third block is not cached
    assert kv.allocate(b, 43 - 32, hits) == []
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert ref_counts(kv, b) == [2, 2, 1]


def test_cached_prefix_never_covers_the_last_prompt_token():
    kv = KVCacheManager(8, BS)
    prefill(kv, Seq("a", prompt(48)))
    assert kv.find_cached_prefix(Seq("same", prompt(48))).num_blocks == 2  # 3 blocks cached, the last token recomputed
    assert kv.find_cached_prefix(Seq("longer", prompt(49))).num_blocks == 3
    assert kv.find_cached_prefix(Seq("one-block", prompt(16))).num_blocks == 0


def test_freed_prefix_is_reused_and_reclaimed_blocks_count_against_the_free_list():
    kv = KVCacheManager(4, BS)
    a = Seq("a", prompt(49))
    prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 3

    too_long = Seq("long", prompt(49) + prompt(40, start=5000))  # 3 cached blocks + 3 new ones > 4
    cached = kv.find_cached_prefix(too_long)
    assert cached.num_blocks == 3
    assert kv.allocate(too_long, 89 - 48, cached) is None
    assert kv.pool.num_free_blocks == 4 and kv.pool.num_cached_blocks == 3

    fits = Seq("fits", prompt(49) + [1])
    cached = kv.find_cached_prefix(fits)
    assert kv.allocate(fits, 2, cached) == []
    assert kv.block_ids("fits")[:3] == [c.block_id for c in cached.blocks[0]]
    assert kv.pool.num_free_blocks == 0


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(8, BS)
    prefill(kv, Seq("a", prompt(40), cache_salt="alice"))
    assert kv.find_cached_prefix(Seq("a2", prompt(40), cache_salt="alice")).num_blocks == 2
    assert kv.find_cached_prefix(Seq("b", prompt(40), cache_salt="bob")).num_blocks == 0
    assert kv.find_cached_prefix(Seq("anon", prompt(40))).num_blocks == 0


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    prefill(kv, Seq("a", prompt(40)))
    assert kv.find_cached_prefix(Seq("b", prompt(40))).num_blocks == 0


def test_fork_with_a_different_uncomputed_token_caches_the_child_under_its_own_tokens():
    # The parent has 32 tokens, 31 computed; its hashes were taken over all 32 on admission. A child forked with
    # another 32nd token (beam search) must register its second block under its own tokens, not the parent's.
    kv = KVCacheManager(8, BS)
    parent = Seq("parent", prompt(32))
    assert kv.find_cached_prefix(parent).num_blocks == 0  # hashes both blocks, uncomputed last token included
    kv.allocate(parent, 31)
    parent.num_computed_tokens = 31
    kv.cache_full_blocks(parent)
    child = Seq("child", prompt(31) + [7], num_computed_tokens=31)
    kv.fork(parent, child)
    assert kv.allocate(child, 1) != []  # copy-on-write of the shared partial block
    child.num_computed_tokens = 32
    kv.cache_full_blocks(child)
    assert kv.find_cached_prefix(Seq("same as child", prompt(31) + [7, 0])).num_blocks == 2
    assert kv.find_cached_prefix(Seq("same as parent", prompt(32) + [0])).num_blocks == 1


def test_each_group_keeps_what_its_kind_needs_and_the_counters_add_up():
    kv = KVCacheManager(16, BS, windows=(None, 20))
    a = Seq("a", prompt(70))
    prefill(kv, a)
    kv.drop_unneeded(a)  # the sliding group's next query reads from token 51: blocks 0-2 are passed
    assert kv.block_table("a", 0).logical == [0, 1, 2, 3, 4] and kv.block_table("a", 1).logical == [3, 4]
    assert (kv.num_window_blocks_freed, kv.num_evicted_blocks) == (3, 0)
    assert (kv.num_stored_tokens(a, 0), kv.num_stored_tokens(a, 1), kv.num_wasted_slots(a)) == (70, 22, 20)
    hit = kv.find_cached_prefix(Seq("b", prompt(80)))  # the passed blocks were registered first: still cached
    assert hit.num_blocks == 4 and hit.first_logical == [0, 2] and [len(blocks) for blocks in hit.blocks] == [4, 2]

    evicting = KVCacheManager(16, BS, eviction=StreamingPolicy(sink_tokens=4, recent_tokens=20))
    prefill(evicting, a := Seq("a", prompt(70)))
    evicting.drop_unneeded(a)
    assert evicting.block_table("a").logical == [0, 3, 4]
    assert (evicting.num_window_blocks_freed, evicting.num_evicted_blocks) == (0, 2)


def test_a_hit_in_several_groups_is_held_before_any_group_takes_new_blocks():
    """The free queue can hold one group's cached blocks of a prefix ahead of everything else; a request hitting that
    prefix must hold them before another group takes new blocks off the front, or they are handed out twice and
    written while served as the prefix (a wrong answer from the cache)."""
    kv = KVCacheManager(8, BS, windows=(None, 64))  # two groups; the window reaches every token here
    x, y = Seq("x", prompt(32)), Seq("y", prompt(32, start=500))
    prefill(kv, x)
    prefill(kv, y)
    kv.free(x)  # the free queue: x's group-0 blocks, x's group-1 blocks, then y's
    kv.free(y)
    b = Seq("b", prompt(32) + prompt(20, start=900))  # x's two blocks in each group, then two new ones in each
    prefill(kv, b)
    tables = [kv.block_table("b", g).blocks for g in range(2)]
    assert [len(t) for t in tables] == [4, 4]
    ids = [block.block_id for table in tables for block in table]
    assert len(set(ids)) == 8  # no block in both groups
    assert all(block.ref_cnt == 1 for table in tables for block in table)
    hit = kv.find_cached_prefix(Seq("c", prompt(32) + [1]))
    assert hit.num_blocks == 2 and [[blk.block_id for blk in g] for g in hit.blocks] == [ids[:2], ids[4:6]]
