"""Eviction policies decide which whole blocks a sequence drops: StreamingLLM keeps the sink blocks and the
blocks any later query's window still reaches; H2O keeps sinks, the recent window and the highest-scored blocks
within its budget. Both bound the blocks a sequence holds, with the same formula the planner uses."""
from kvserve.kv.eviction import EvictionPolicy, H2OPolicy, StreamingPolicy, make_policy

BS = 16


def test_streaming_drops_only_blocks_no_later_query_reads():
    policy = StreamingPolicy(sink_tokens=4, recent_tokens=40)
    logical = list(range(10))  # tokens 0..159 held; the next query is at position 160
    dropped = policy.blocks_to_drop(logical, 160, BS)
    # window of the query at 160: positions 121..160 -> blocks 7.. are read; block 0 holds the sinks
    assert dropped == [1, 2, 3, 4, 5, 6]
    kept = [b for i, b in enumerate(logical) if i not in dropped]
    assert len(kept) + 1 <= policy.max_blocks(BS) == 1 + 3 + 1
    assert policy.blocks_to_drop(kept, 160, BS) == []  # nothing more until the window moves on


def test_streaming_without_sinks_keeps_only_the_window():
    policy = StreamingPolicy(sink_tokens=0, recent_tokens=32)
    assert policy.blocks_to_drop(list(range(6)), 96, BS) == [0, 1, 2, 3]


def test_h2o_keeps_sinks_recent_and_the_heaviest_blocks():
    policy = H2OPolicy(sink_tokens=4, recent_tokens=20, budget_tokens=64)  # 4 blocks kept
    logical = list(range(7))  # the next query is at position 112: block 7; recent 92..111 is blocks 5, 6
    scores = [9.0, 1.0, 7.0, 3.0, 8.0, 0.5, 0.1]
    dropped = policy.blocks_to_drop(logical, 112, BS, scores)
    # droppable: blocks 1..4 (not the sink block 0, not the recent blocks 5 and 6); keep the heaviest one, 4
    assert dropped == [1, 2, 3]
    assert len(logical) - len(dropped) == 4 == policy.max_blocks(BS) - 1


def test_h2o_drops_nothing_within_its_budget():
    policy = H2OPolicy(sink_tokens=4, recent_tokens=20, budget_tokens=64)
    assert policy.blocks_to_drop([0, 1, 2, 3], 60, BS, [0.0] * 4) == []


def test_no_eviction_is_unbounded_and_drops_nothing():
    policy = make_policy("none", 4, 1024, 2048)
    assert policy == EvictionPolicy() and not policy.evicts
    assert policy.max_blocks(BS) is None and policy.blocks_to_drop(list(range(100)), 1600, BS) == []


def test_only_tokens_every_query_saw_whole_are_exact():
    assert StreamingPolicy(sink_tokens=4, recent_tokens=40).exact_tokens() == 44
    assert H2OPolicy(sink_tokens=4, recent_tokens=20, budget_tokens=64).exact_tokens() is None  # until it evicts
