"""Prefix hits across layer groups: a full group needs every block of the prefix, a sliding group only the window
before its end; each group caches its own blocks under its own key; a fork inherits only computed blocks' hashes."""
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.eviction import EvictionPolicy
from kvserve.kv.group_managers import make_group_managers
from kvserve.kv.prefix_lookup import PrefixLookup, RequestHashes
from tests.kv.sequences import BS, Seq


def lookup_for(windows) -> PrefixLookup:
    pool = BlockPool(16)
    return PrefixLookup(pool, make_group_managers(pool, BS, windows, EvictionPolicy()))


def test_the_hit_is_the_longest_prefix_every_group_can_continue_after():
    prefixes = lookup_for((None, 20))
    b = [Block(i) for i in range(10)]
    full = [b[0], b[1], b[2], b[3], None]
    sliding = [None, None, b[4], None, b[5]]  # holds only blocks 2 and 4
    hit = prefixes.longest_prefix([full, sliding])
    # the full group stops at 4 blocks; after n blocks the next query reads 20 tokens back, so the sliding group
    # needs blocks 2-3 (n=4), 1-2 (n=3), 0-1 (n=2), 0 (n=1): each misses one; the empty prefix is always held
    assert hit.num_blocks == 0
    sliding[1] = b[6]
    sliding[3] = b[7]
    hit = prefixes.longest_prefix([full, sliding])
    assert hit.num_blocks == 4 and hit.first_logical == [0, 2]
    assert hit.blocks == [[b[0], b[1], b[2], b[3]], [b[4], b[7]]]


def test_longest_held_scans_for_a_full_groups_gap_past_the_known_part():
    prefixes = lookup_for((None,))
    asked = []

    def held(group, i):
        asked.append(i)
        return i < 5

    assert prefixes.longest_held(held, 3, 8) == 5
    assert asked[:3] == [3, 4, 5]  # the full group looks for its first missing block from the known part on


def test_each_group_keys_its_own_blocks():
    one, two = lookup_for((None,)), lookup_for((None, 20))
    key = b"k" * 8
    assert one.key(key, 0) == key
    assert two.key(key, 0) != two.key(key, 1)


def test_a_fork_inherits_the_hashes_of_computed_blocks_only():
    hashes = RequestHashes(BS)
    parent = Seq("p", list(range(40)), num_computed_tokens=20)
    assert len(hashes.block_hashes(parent)) == 2
    assert len(hashes.prompt_hashes(Seq("q", list(range(33))))) == 2  # the last token is always computed
    child = Seq("c", list(range(39)) + [7], num_computed_tokens=20)
    hashes.fork(parent, child)
    assert hashes.block_hashes(child, 16) == hashes.block_hashes(parent, 16)
    hashes.free("p")
    assert hashes.block_hashes(child) == RequestHashes(BS).block_hashes(child)
