"""The block pool hands out only unreferenced blocks, least recently freed first, keeps freed blocks findable by
their prefix hash until it reuses them, and refuses double frees and requests beyond the free list."""
import random

import pytest

from kvserve.kv.block_hash import hash_block
from kvserve.kv.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocate_takes_free_blocks_in_order_with_one_reference():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 3)
    assert ids(pool.allocate(2)) == [3, 4]


def test_touch_and_free_count_references():
    pool = BlockPool(4)
    block = pool.allocate(1)[0]
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3  # still held by its other user
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4


def test_least_recently_freed_block_is_reused_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.free([c])
    pool.free([a])
    pool.free([d])
    assert ids(pool.allocate(3)) == [c.block_id, a.block_id, d.block_id]


def test_blocks_freed_tail_first_are_reused_tail_first():
    pool = BlockPool(6)
    head, middle, tail = pool.allocate(3)
    pool.free([tail, middle, head])  # what KVCacheManager.free passes for a finished request
    # never-used blocks 3..5 come first, then the request's tail, its head last
    assert ids(pool.allocate(6)) == [3, 4, 5, tail.block_id, middle.block_id, head.block_id]


def test_freed_block_stays_findable_by_hash_until_reallocated():
    pool = BlockPool(2)
    block, other = pool.allocate(2)
    key = hash_block(None, list(range(16)))
    pool.register(block, key)
    pool.free([block])
    assert pool.lookup(key) is block
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 1

    reused = pool.allocate(1)[0]  # the only free block: its cached content is evicted
    assert reused is block
    assert pool.lookup(key) is None
    assert block.block_hash is None and pool.num_cached_blocks == 0


def test_reset_forgets_cached_prefixes_only_when_no_block_is_held():
    pool = BlockPool(3)
    events = pool.subscribe_hash_events()
    cached, held = pool.allocate(2)
    keys = [hash_block(None, [1]), hash_block(None, [2])]
    pool.register(cached, keys[0])
    pool.register(held, keys[1])
    pool.free([cached])
    assert not pool.reset_prefix_cache()  # `held` is still in use: nothing changes
    assert pool.lookup(keys[0]) is cached and pool.lookup(keys[1]) is held
    pool.free([held])
    assert pool.reset_prefix_cache()
    assert pool.lookup(keys[0]) is None and pool.lookup(keys[1]) is None and pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 3 and cached.block_hash is None
    assert sorted(e for e in events if not e[0]) == sorted((False, k) for k in keys)  # subscribers hear of it


def test_touching_a_cached_free_block_takes_it_off_the_free_list():
    pool = BlockPool(3)
    block = pool.allocate(1)[0]
    key = hash_block(None, [1, 2, 3])
    pool.register(block, key)
    pool.free([block])
    pool.touch([pool.lookup(key)])  # a prefix hit revives it
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert block.block_id not in ids(pool.allocate(2))
    assert pool.lookup(key) is block


def test_first_block_registered_under_a_hash_keeps_it():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    key = hash_block(None, [7] * 16)
    pool.register(first, key)
    pool.register(second, key)
    assert pool.lookup(key) is first
    assert second.block_hash is None
    pool.free([second])
    pool.allocate(2)  # evicting `second` must not drop `first` from the index
    assert pool.lookup(key) is first



def test_hash_events_replay_what_is_findable_then_follow_registrations_and_evictions():
    pool = BlockPool(2)
    early, late = hash_block(None, [1] * 4), hash_block(None, [2] * 4)
    first = pool.allocate(1)[0]
    pool.register(first, early)
    events = pool.subscribe_hash_events()
    assert list(events) == [(True, early)]  # a late subscriber starts from what is findable now
    events.clear()
    second = pool.allocate(1)[0]
    pool.register(second, late)
    pool.register(second, late)  # already registered: no second event
    pool.free([first, second])
    pool.allocate(1)  # reuses `first`, evicting its key
    assert list(events) == [(True, late), (False, early)]
    assert pool.subscribe_hash_events() is events

def test_prefix_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    block = pool.allocate(1)[0]
    key = hash_block(None, [1])
    pool.register(block, key)
    pool.free([block])
    assert pool.lookup(key) is None and pool.num_cached_blocks == 0


def test_referenced_blocks_are_never_handed_out():
    rng = random.Random(0)
    pool = BlockPool(16)
    held: list = []
    for _ in range(500):
        if held and (rng.random() < 0.4 or pool.num_free_blocks == 0):
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
        elif held and rng.random() < 0.2:
            block = rng.choice(held)
            pool.touch([block])
            held.append(block)
        else:
            n = rng.randint(1, pool.num_free_blocks)
            referenced = {b.block_id for b in held}
            taken = pool.allocate(n)
            assert not referenced & set(ids(taken))
            assert len(set(ids(taken))) == n
            held.extend(taken)
        assert pool.num_used_blocks == len({b.block_id for b in held})
        assert all(b.ref_cnt == held.count(b) for b in pool.blocks)
    pool.free(held)
    assert pool.num_free_blocks == 16


def test_double_free_is_caught_and_leaves_the_pool_intact():
    pool = BlockPool(3)
    block = pool.allocate(1)[0]
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 3
    assert sorted(ids(pool.allocate(3))) == [0, 1, 2]  # listed once, handed out once


def test_asking_for_more_blocks_than_free_raises_and_takes_none():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks with only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_a_pool_needs_a_block(num_blocks):
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(num_blocks)
