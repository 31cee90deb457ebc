"""The prefix router's picture of the replicas: a request's cached run is the leading keys a replica's snapshot or
its recent routes hold; routes expire; the longest run wins unless the load is too uneven."""
import random

from kvserve.scaleout.prefix_index import PrefixIndex, pack_keys, rank_replicas, unpack_keys

A, B, C, D = (bytes([i]) * 8 for i in range(1, 5))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_cached_run_counts_leading_keys_of_the_snapshot_only():
    index = PrefixIndex(recent_ttl_s=5)
    index.update_snapshot("r1", 1, pack_keys([A, B, D]))
    assert index.num_cached_blocks("r1", [A, B, C, D]) == 2  # D is cached but after a miss: unusable
    assert index.num_cached_blocks("r1", [B]) == 1
    assert index.num_cached_blocks("r2", [A]) == 0


def test_a_new_snapshot_version_replaces_the_old_one():
    index = PrefixIndex(recent_ttl_s=5)
    index.update_snapshot("r1", 1, pack_keys([A, B]))
    index.update_snapshot("r1", 2, pack_keys([A]))  # B was evicted
    assert index.num_cached_blocks("r1", [A, B]) == 1


def test_routed_prompts_count_until_they_expire():
    clock = Clock()
    index = PrefixIndex(recent_ttl_s=5, clock=clock)
    index.record_routed("r1", [A, B])
    assert index.num_cached_blocks("r1", [A, B, C]) == 2
    clock.now += 6
    assert index.num_cached_blocks("r1", [A, B, C]) == 0
    index.update_snapshot("r1", 1, pack_keys([A]))
    assert index.num_cached_blocks("r1", [A, B]) == 1


def test_forgetting_a_replica_drops_everything_it_held():
    index = PrefixIndex(recent_ttl_s=5)
    index.update_snapshot("r1", 1, pack_keys([A]))
    index.record_routed("r1", [A, B])
    index.forget("r1")
    assert index.num_cached_blocks("r1", [A, B]) == 0


def test_keys_pack_and_unpack():
    assert unpack_keys(pack_keys([A, B, C])) == {A, B, C}
    assert unpack_keys(b"") == frozenset()


def test_longest_cached_run_wins_while_load_is_even():
    order = rank_replicas({"r1": 3, "r2": 7, "r3": 0}, {"r1": 0, "r2": 4, "r3": 1}, imbalance_threshold=4,
                          num_blocks=8)
    assert order == ["r2", "r1", "r3"]


def test_past_the_threshold_the_least_loaded_wins():
    order = rank_replicas({"r1": 3, "r2": 7}, {"r1": 0, "r2": 5}, imbalance_threshold=4)
    assert order == ["r1", "r2"]


def test_without_a_cached_prefix_the_least_loaded_wins_and_ties_spread():
    assert rank_replicas({"r1": 0, "r2": 0}, {"r1": 2, "r2": 1}, imbalance_threshold=8)[0] == "r2"
    firsts = {rank_replicas({"r1": 0, "r2": 0}, {"r1": 0, "r2": 0}, 8, random.Random(seed))[0] for seed in range(20)}
    assert firsts == {"r1", "r2"}


def test_working_set_counts_distinct_routed_keys_until_the_window_passes():
    clock = Clock()
    index = PrefixIndex(recent_ttl_s=5, working_set_s=60, clock=clock)
    index.record_routed("r1", [A, B])
    index.record_routed("r1", [A, B, C])  # the conversation's next turn: one new block
    assert index.working_set_blocks("r1") == 3
    clock.now += 30
    index.record_routed("r1", [D])
    clock.now += 31  # A, B, C last routed 61 s ago
    assert index.working_set_blocks("r1") == 1
    assert index.num_cached_blocks("r1", [D]) == 0  # the short cached presumption expired long before


def test_pressure_is_the_working_set_over_the_published_capacity():
    index = PrefixIndex(recent_ttl_s=5)
    index.record_routed("r1", [A, B])
    assert index.pressure("r1") == 2  # no capacity published yet: blocks
    index.update_snapshot("r1", 1, b"", capacity_blocks=8)
    assert index.pressure("r1") == 0.25
    index.forget("r1")
    assert index.pressure("r1") == 0


def test_new_conversations_go_where_the_cache_is_least_pressed():
    pressures = {"r1": 0.9, "r2": 0.2}
    assert rank_replicas({"r1": 0, "r2": 0}, {"r1": 0, "r2": 3}, 8, pressures=pressures, num_blocks=4)[0] == "r2"
    # a cached prefix still wins over pressure, and a load past the threshold over both
    assert rank_replicas({"r1": 4, "r2": 0}, {"r1": 0, "r2": 0}, 8, pressures=pressures, num_blocks=5)[0] == "r1"
    assert rank_replicas({"r1": 0, "r2": 0}, {"r1": 0, "r2": 9}, 8, pressures=pressures, num_blocks=4)[0] == "r1"


def place_new_conversations(prefix: list[bytes], count: int = 8) -> list[str]:
    """Route `count` new two-block conversations behind `prefix` over two equal replicas, as the router would."""
    index = PrefixIndex(recent_ttl_s=5)
    for rid in ("r1", "r2"):
        index.update_snapshot(rid, 1, b"", capacity_blocks=100)
    placed = []
    for i in range(count):
        keys = [*prefix, bytes([i + 10]) * 8, bytes([i + 100]) * 8]
        cached = {rid: index.num_cached_blocks(rid, keys) for rid in ("r1", "r2")}
        pressures = {rid: index.pressure(rid) for rid in ("r1", "r2")}
        best = rank_replicas(cached, {"r1": 0, "r2": 0}, 8, random.Random(i), pressures, num_blocks=len(keys))[0]
        index.record_routed(best, keys)
        placed.append(best)
    return placed


def test_a_stream_of_new_conversations_alternates_between_equal_replicas():
    placed = place_new_conversations([])
    assert placed.count("r1") == placed.count("r2") == 4


def test_a_conversation_that_moves_leaves_its_old_working_set():
    index = PrefixIndex(recent_ttl_s=5)
    index.record_routed("r1", [A, B])
    index.record_routed("r2", [A, B, C])  # its next turn went elsewhere (its prefix was evicted on r1)
    assert index.working_set_blocks("r1") == 0
    assert index.working_set_blocks("r2") == 3
    assert index.num_cached_blocks("r1", [A, B]) == 2  # r1 may still hold it: the cached presumption stays


def test_a_short_shared_prefix_earns_no_affinity():
    pressures = {"r1": 0.5, "r2": 0.1}
    # a new conversation whose first of 10 blocks (a system prompt) only r1 has seen goes where there is room
    assert rank_replicas({"r1": 1, "r2": 0}, {"r1": 0, "r2": 0}, 8, pressures=pressures, num_blocks=10)[0] == "r2"
    # a returning one, with most of its prompt cached on r1, stays there
    assert rank_replicas({"r1": 8, "r2": 1}, {"r1": 0, "r2": 0}, 8, pressures=pressures, num_blocks=10)[0] == "r1"


def test_conversations_behind_one_system_prompt_spread_over_the_replicas():
    placed = place_new_conversations([b"s" * 8])  # the first block, shared by all: seen on one replica first
    assert placed.count("r1") == placed.count("r2") == 4


def test_a_request_without_a_full_block_goes_by_load_alone():
    order = rank_replicas({"r1": 0, "r2": 0}, {"r1": 0, "r2": 2}, 8, pressures={"r1": 0.9, "r2": 0.1}, num_blocks=0)
    assert order == ["r1", "r2"]
