"""Per-(layer, KV head) streams under the coordinator: compression frees exactly the head blocks it says it frees,
keeps the sinks, the filling block and the recent window in every stream, moves each kept token's K/V with it, and
every block comes back when sequences finish or fork."""
import pytest
import torch

from kvserve.kv.eviction import make_policy
from kvserve.kv.head_streams import HeadStreamKVCache, QueryRecord
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.kv.scorers import KeyNormScorer
from kvserve.planner.layout import KVLayout
from tests.kv.sequences import Seq

LAYERS, HEADS, DIM, BS = 2, 3, 8, 16
SINKS, RECENT, BUDGET = 4, 8, 40


def code(positions: torch.Tensor, layer: int) -> torch.Tensor:
    """K/V a token stores: [T, heads, DIM], each value names its position, layer and head (so moves can be checked)."""
    heads = torch.arange(HEADS)[None, :, None]
    return (positions[:, None, None] * 100 + layer * 10 + heads).float().expand(-1, -1, DIM).clone()


def build(name: str = "adakv", num_blocks: int = 400):
    policy = make_policy(name, SINKS, RECENT, BUDGET)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, eviction=policy)
    storage = HeadStreamKVCache(KVLayout.uniform(LAYERS), num_blocks, BS, HEADS, DIM, num_query_heads=HEADS)
    kv.groups[0].attach(storage, KeyNormScorer())
    return kv, storage


def run(kv: KVCacheManager, storage: HeadStreamKVCache, seq: Seq, n: int, compress: bool = True) -> None:
    """One step of `n` new tokens: allocate, write their K/V in every stream, advance, compress (if `compress`)."""
    assert kv.allocate(seq, n) is not None
    slots = kv.groups[0].reserve(seq.request_id, n)
    positions = torch.arange(seq.num_computed_tokens, seq.num_computed_tokens + n)
    record = QueryRecord([seq.request_id], torch.zeros(n, dtype=torch.long), torch.ones(n), torch.ones(n, 1, DIM),
                         torch.zeros(n, 1, DIM))
    storage.begin_head_step(slots.permute(0, 2, 1), positions, kv.groups[0].take_fresh_blocks(), record)
    for layer in range(LAYERS):
        storage.write(layer, code(positions, layer), -code(positions, layer))
    storage.end_head_step()
    seq.token_ids += [5] * n
    seq.num_computed_tokens += n
    if compress:
        kv.drop_unneeded(seq)


def stream_positions(kv, storage, seq) -> list[list[list[int]]]:
    streams = kv.groups[0].streams[seq.request_id]
    keys, _, positions = storage.gather_streams(streams.tables[:, :, : int(streams.num_blocks.max())])
    return [[positions[l, h, : streams.lengths[l, h]].tolist() for h in range(HEADS)] for l in range(LAYERS)]


@pytest.mark.parametrize("name", ["adakv", "adakv-layers", "perhead", "perhead-mix", "perhead-span"])
def test_compression_frees_what_it_counts_and_keeps_sinks_filling_block_and_window(name):
    kv, storage = build(name)
    seq = Seq("a")
    run(kv, storage, seq, 30)
    assert kv.num_evicted_blocks == 0  # under budget + a block: nothing to do
    run(kv, storage, seq, 45, compress=False)  # 75 stored per head, to be compressed to 40 on average
    free_before, evicted_before = kv.pool.num_free_blocks, kv.num_evicted_blocks
    kv.drop_unneeded(seq)
    freed = kv.num_evicted_blocks - evicted_before
    streams = kv.groups[0].streams["a"]
    assert freed > 0 and kv.pool.num_free_blocks - free_before == freed
    assert torch.equal(streams.num_blocks, -(-streams.lengths // BS))  # no head block beyond what it stores
    if kv.eviction.across_layers:  # one pool over every layer: the layers' shares differ, the total is the budget's
        assert int(streams.lengths.sum()) == BUDGET * HEADS * LAYERS
        assert len(set(streams.lengths.sum(1).tolist())) == LAYERS
    else:
        assert torch.equal(streams.lengths.sum(1), torch.full((LAYERS,), BUDGET * HEADS))
    if not kv.eviction.adaptive:
        assert bool((streams.lengths == BUDGET).all())
    position = seq.num_computed_tokens
    protect_from = min(position - RECENT, position - position % BS)
    for layer in stream_positions(kv, storage, seq):
        for kept in layer:
            assert kept == sorted(kept)
            assert set(range(SINKS)) | set(range(protect_from, position)) <= set(kept)


def test_kept_tokens_move_with_their_k_and_v():
    kv, storage = build()
    seq = Seq("a")
    for n in (50, 40, 1, 1, 30):
        run(kv, storage, seq, n)
    streams = kv.groups[0].streams["a"]
    keys, values, positions = storage.gather_streams(streams.tables[:, :, : int(streams.num_blocks.max())])
    for l in range(LAYERS):
        for h in range(HEADS):
            n = int(streams.lengths[l, h])
            expected = code(positions[l, h, :n].long(), l)[:, h]
            assert torch.equal(keys[l, h, :n], expected) and torch.equal(values[l, h, :n], -expected)


def test_every_block_comes_back_after_free_and_fork():
    kv, storage = build()
    parent, other = Seq("p"), Seq("o")
    run(kv, storage, parent, 70)
    run(kv, storage, other, 20)
    child = Seq("c", list(parent.token_ids), parent.num_computed_tokens)
    kv.fork(parent, child)
    assert stream_positions(kv, storage, child) == stream_positions(kv, storage, parent)
    run(kv, storage, child, 3)
    kv.free(parent)
    run(kv, storage, child, 20)
    for seq in (child, other):
        kv.free(seq)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_allocation_fails_without_changing_anything_when_the_pool_is_short():
    kv, storage = build(num_blocks=LAYERS * HEADS * 3)
    seq = Seq("a")
    run(kv, storage, seq, 40)  # 3 head blocks in every stream: the pool is full
    assert kv.pool.num_free_blocks == 0
    assert kv.allocate(seq, 10) is None
    assert kv.groups[0].streams["a"].num_blocks.sum() == LAYERS * HEADS * 3


def test_weighted_heads_keep_their_own_shares_and_the_sequence_holds_the_budget_on_average():
    policy = make_policy("headkv-span", SINKS, RECENT, BUDGET)
    kv = KVCacheManager(400, BS, enable_prefix_caching=True, eviction=policy)
    storage = HeadStreamKVCache(KVLayout.uniform(LAYERS), 400, BS, HEADS, DIM, num_query_heads=HEADS)
    weights = torch.tensor([[0.75, 1.5, 0.75], [1.0, 1.0, 1.0]])
    for wrong, match in ((None, "needs head weights"), (torch.ones(3, 2), "shape"),
                         (torch.full((LAYERS, HEADS), 1.1), "average at most 1"),
                         (torch.tensor([[0.1, 1.9, 1.0], [1.0, 1.0, 1.0]]), "smallest share")):
        with pytest.raises(ValueError, match=match):
            kv.groups[0].attach(storage, KeyNormScorer(), wrong)
    kv.groups[0].attach(storage, KeyNormScorer(), weights)
    seq = Seq("a")
    run(kv, storage, seq, 100)  # 100 stored per head: compressed to each head's share
    streams = kv.groups[0].streams["a"]
    assert torch.equal(streams.lengths, (weights * BUDGET).long())
    assert torch.equal(streams.num_blocks, -(-streams.lengths // BS))
    run(kv, storage, seq, 10)  # 50 on average, under budget + a block: nothing dropped
    assert torch.equal(streams.lengths, (weights * BUDGET).long() + 10)
    kv.free(seq)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_policy_without_weights_refuses_them():
    kv, storage = build("perhead-span")
    with pytest.raises(ValueError, match="takes no head weights"):
        kv.groups[0].attach(storage, KeyNormScorer(), torch.ones(LAYERS, HEADS))
