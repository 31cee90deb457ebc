"""A replica publishes the routing keys its prefix cache holds, following registrations and evictions, plus the keys
of the requests it is serving; a key that two layer groups cache stays until both lose it."""
from kvserve.kv.block_hash import hash_block
from kvserve.kv.block_pool import BlockPool
from kvserve.scaleout.prefix_index import routing_key, unpack_keys
from kvserve.scaleout.published_blocks import PublishedBlocks


def test_snapshot_follows_registrations_and_evictions():
    pool = BlockPool(2)
    first, second = hash_block(None, [1, 2]), hash_block(None, [3, 4])
    a = pool.allocate(1)[0]
    pool.register(a, first)
    published = PublishedBlocks(pool)  # subscribes late: sees what is cached already
    b = pool.allocate(1)[0]
    pool.register(b, second)
    assert unpack_keys(published.snapshot()) == {routing_key(first), routing_key(second)}
    pool.free([a, b])
    pool.allocate(1)  # evicts `first`
    assert unpack_keys(published.snapshot()) == {routing_key(second)}


def test_keys_of_requests_being_served_are_published_until_they_end():
    published = PublishedBlocks(BlockPool(2))
    keys = (b"k" * 8, b"j" * 8)
    published.start_serving(keys)
    published.start_serving(keys[:1])
    published.stop_serving(keys)
    assert unpack_keys(published.snapshot()) == {keys[0]}
    published.stop_serving(keys[:1])
    assert published.snapshot() == b""


def test_a_key_cached_by_two_layer_groups_stays_until_both_evict_it():
    pool = BlockPool(3)
    base = hash_block(None, [5, 6])
    published = PublishedBlocks(pool)
    blocks = pool.allocate(2)
    for group, block in enumerate(blocks):  # KVCacheManager keys hybrid groups as hash + group byte
        pool.register(block, base + bytes([group]))
    pool.free(blocks)
    pool.allocate(2)  # takes the spare block, then evicts group 0's
    assert unpack_keys(published.snapshot()) == {routing_key(base)}
    pool.allocate(1)
    assert published.snapshot() == b""
