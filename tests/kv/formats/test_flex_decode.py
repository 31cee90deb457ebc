"""float32 decode attention over the blocks where they lie (flex_attention with a block mask): equal to the eager
read (gather, then scaled_dot_product_attention) within float32 rounding, for any batch after one warm-up; a
request's row does not depend on the rest of its batch, nor on the order a step's requests are attended in (balanced
over the kernel's threads); masks it cannot express, one request alone, and a cache that does not compile are left
to the eager read."""
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters

from kvserve import saved_graphs
from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats import flex_decode
from kvserve.kv.formats.flex_decode import (InPlaceFloatKVCache, block_mask_inputs, thread_balanced_order,
                                              thread_shares)
from kvserve.kv.kv_cache import FullPrecisionKVCache
from kvserve.planner.layout import KVLayout

BS = 4
HEADS, PER_HEAD, DIM = 2, 3, 16


def filled_cache(blocks: int, compile: bool = True, dtype=torch.float32):
    cache = make_kv_cache(KVCacheSpec("float32", KVLayout.uniform(2), blocks, BS, HEADS, DIM, dtype, compile=compile,
                                      decode_in_place=True))
    g = torch.Generator().manual_seed(0)
    cache.begin_step([], [], [torch.arange(blocks * BS)])
    for layer in range(2):
        cache.write(layer, torch.randn(blocks * BS, HEADS, DIM, generator=g).to(dtype) * 2,
                    torch.randn(blocks * BS, HEADS, DIM, generator=g).to(dtype))
    cache.begin_step([], [], [torch.tensor([0])])
    return cache


def eager(cache, layer, queries, tables, mask, scale):
    keys, values = cache.gather(layer, tables)
    return F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                          scale=scale)


def decode_masks(g: torch.Generator, S: int, B: int, window: bool) -> torch.Tensor:
    """Each request reads a prefix of its B blocks (its last block partly filled), with a sliding window its keys
    from some point of its first block on: at most two partial blocks each."""
    lengths = torch.randint((B - 1) * BS + 1, B * BS + 1, (S,), generator=g)
    starts = torch.randint(0, BS, (S,), generator=g) if window else torch.zeros(S, dtype=torch.long)
    keys = torch.arange(B * BS)
    return ((keys >= starts[:, None]) & (keys < lengths[:, None]))[:, None, None, :]


def test_float32_on_a_cpu_is_read_in_place_when_asked_unless_compiling_is_off():
    assert isinstance(filled_cache(4), InPlaceFloatKVCache)
    assert "compiled decode attention in place" in filled_cache(4).describe()
    assert type(filled_cache(4, compile=False)) is FullPrecisionKVCache
    assert not filled_cache(4, compile=False).decode_reads_in_place()
    not_asked = make_kv_cache(KVCacheSpec("float32", KVLayout.uniform(1), 4, BS, HEADS, DIM, torch.float32))
    stored_narrower = make_kv_cache(KVCacheSpec("bfloat16", KVLayout.uniform(1), 4, BS, HEADS, DIM, torch.float32,
                                                decode_in_place=True))  # flex_attention takes one dtype for q, k and v
    assert type(not_asked) is type(stored_narrower) is FullPrecisionKVCache


@pytest.mark.parametrize("window", [False, True])
def test_in_place_equals_attention_over_the_eager_read(window):
    cache = filled_cache(40)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    assert cache.decode_reads_in_place()
    g = torch.Generator().manual_seed(1)
    for S, B in [(2, 1), (3, 5), (9, 2), (4, 12)]:
        tables = torch.stack([torch.randperm(40, generator=g)[:B] for _ in range(S)])  # blocks shared, any order
        mask = decode_masks(g, S, B, window)
        with torch.inference_mode():
            queries = torch.randn(S, HEADS, PER_HEAD, DIM, generator=g)
            for layer in range(2):
                cache.begin_step([], [], [torch.zeros(S, dtype=torch.long)])
                out = cache.decode_attention(layer, queries, tables, None, None, None, mask, 0.3)
                assert out is not None and out.shape == (S, HEADS, PER_HEAD, DIM)
                torch.testing.assert_close(out, eager(cache, layer, queries, tables, mask, 0.3), atol=2e-6, rtol=2e-5)


def test_a_later_cache_loads_the_saved_kernel_and_reads_every_batch_without_tracing(monkeypatch):
    """The warm-up saves its graph whole (kvserve/saved_graphs.py); a cache of another pool size, with this process's
    kernels forgotten as in a new process, loads it, runs no Dynamo, and reads every batch as the eager read."""
    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})
    filled_cache(40).warm_up(num_query_heads=HEADS * PER_HEAD)
    saved_graphs.PROCESS_GRAPHS.clear()
    counters.clear()
    cache = filled_cache(24)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    assert (cache.fused_decode.graphs_loaded, cache.fused_decode.graphs_compiled) == (1, 0)
    g = torch.Generator().manual_seed(5)
    for S, B in [(2, 1), (3, 5), (9, 2), (4, 12)]:
        tables = torch.stack([torch.randperm(24, generator=g)[:B] for _ in range(S)])
        mask = decode_masks(g, S, B, window=True)
        with torch.inference_mode():
            queries = torch.randn(S, HEADS, PER_HEAD, DIM, generator=g)
            cache.begin_step([], [], [torch.zeros(S, dtype=torch.long)])
            out = cache.decode_attention(1, queries, tables, None, None, None, mask, 0.3)
            assert out is not None
            torch.testing.assert_close(out, eager(cache, 1, queries, tables, mask, 0.3), atol=2e-6, rtol=2e-5)
    assert counters["stats"]["unique_graphs"] == 0 and cache.decode_reads_in_place()


class Registered:
    """A class an import registers with torch's pytree after the warm-up, as transformers registers its outputs."""


def test_a_class_registered_with_torchs_pytree_after_warm_up_turns_no_call_away(monkeypatch):
    """The block mask is a pytree, and Dynamo guards how many classes the pytree knows: without dropping that guard
    a process that imported transformers after its warm-up read every batch eagerly (bench's second round)."""
    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})
    cache = filled_cache(40)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    g = torch.Generator().manual_seed(4)
    tables = torch.stack([torch.randperm(40, generator=g)[:5] for _ in range(3)])
    mask = decode_masks(g, 3, 5, window=False)
    pytree.register_pytree_node(Registered, lambda r: ((), None), lambda children, context: Registered())
    try:
        with torch.inference_mode():
            queries = torch.randn(3, HEADS, PER_HEAD, DIM, generator=g)
            cache.begin_step([], [], [torch.zeros(3, dtype=torch.long)])
            out = cache.decode_attention(0, queries, tables, None, None, None, mask, 0.3)
    finally:
        pytree._deregister_pytree_node(Registered)
    assert out is not None
    torch.testing.assert_close(out, eager(cache, 0, queries, tables, mask, 0.3), atol=2e-6, rtol=2e-5)


def test_a_request_reads_the_same_whatever_its_batch():
    cache = filled_cache(40)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    g = torch.Generator().manual_seed(3)
    tables = torch.stack([torch.randperm(40, generator=g)[:10] for _ in range(8)])
    mask = decode_masks(g, 8, 10, window=False)
    mask[3:, ..., 5 * BS:] = False  # the others shorter: alone, its batch would be padded to none of them
    with torch.inference_mode():
        queries = torch.randn(8, HEADS, PER_HEAD, DIM, generator=g)
        together = cache.decode_attention(0, queries, tables, None, None, None, mask, 0.3)
        cache.begin_step([], [], [torch.zeros(2, dtype=torch.long)])
        for other in range(1, 8):
            pair = cache.decode_attention(0, queries[[0, other]], tables[[0, other]], None, None, None,
                                          mask[[0, other]], 0.3)
            assert torch.equal(pair[0], together[0])  # bitwise
            cache.begin_step([], [], [torch.zeros(2, dtype=torch.long)])


def test_after_warm_up_no_batch_shape_or_pool_size_compiles_again():
    cache = filled_cache(40)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    compiled = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(2)
    for blocks in (40, 13):  # another engine's pool, warmed up as an engine warms its own: nothing compiled
        cache = filled_cache(blocks)
        cache.warm_up(num_query_heads=HEADS * PER_HEAD)
        for S, B in [(2, 1), (3, 7), (9, 4), (5, 13)]:
            tables = torch.randint(0, blocks, (S, B), generator=g)  # as the engine makes them: the batch's tensors
            mask = decode_masks(g, S, B, window=True)  # outside inference mode, the model's inside
            with torch.inference_mode():
                cache.begin_step([], [], [torch.zeros(S, dtype=torch.long)])
                out = cache.decode_attention(1, torch.randn(S, HEADS, PER_HEAD, DIM, generator=g), tables, None,
                                             None, None, mask, 0.2)
            assert out is not None
    assert counters["stats"]["unique_graphs"] == compiled


def test_what_it_cannot_express_is_left_to_the_eager_read():
    cache = filled_cache(8)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    queries = torch.zeros(2, HEADS, PER_HEAD, DIM)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    holes = torch.ones(2, 1, 1, 3 * BS, dtype=torch.bool)
    holes[0, ..., [1, BS + 1, 2 * BS + 1]] = False  # three partly read blocks
    assert cache.decode_attention(0, queries, tables, None, None, None, holes, 1.0) is None
    one = torch.ones(1, 1, 1, 3 * BS, dtype=torch.bool)  # one request alone: torch 2.13 fails to compile it
    assert cache.decode_attention(0, queries[:1], tables[:1], None, None, None, one, 1.0) is None


def test_block_mask_inputs_list_whole_and_partial_blocks_in_table_order():
    tables = torch.tensor([[7, 2, 5, 1], [3, 6, 0, 0]])
    keys = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],  # partial, full, partial, none
                         [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    num_full, full_ids, num_partial, partial_ids, first_partial, partial_keys = block_mask_inputs(
        tables, keys[:, None, None, :], BS, num_blocks=9)
    assert num_full.tolist() == [1, 1] and num_partial.tolist() == [2, 1]
    assert full_ids.shape == partial_ids.shape == (2, 9)  # the pool's width
    assert full_ids[0, 0] == 2 and full_ids[1, 0] == 3
    assert partial_ids[0, :2].tolist() == [7, 5] and partial_ids[1, 0] == 6 and first_partial.tolist() == [7, 6]
    assert partial_keys[0].int().tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert partial_keys[1, 0].int().tolist() == [1, 0, 0, 0]


def test_a_cache_whose_kernel_fails_reads_as_gathered_and_a_later_cache_compiles_its_own(monkeypatch):
    """A machine that cannot compile: the cache says so once and decodes over the gathered read (the runner then
    buckets: decode_reads_in_place); the failure is that cache's own, not the process's."""
    def no_compiler(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("no working C++ compiler found")
        return fails

    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})  # compiled here, not an earlier test's kernel
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", no_compiler)
        broken = filled_cache(8)
        broken.warm_up(num_query_heads=HEADS * PER_HEAD)
    assert not broken.decode_reads_in_place() and "eager decode attention in place" in broken.describe()
    tables, mask = torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 1, 1, 2 * BS, dtype=torch.bool)
    healthy = filled_cache(8)
    healthy.warm_up(num_query_heads=HEADS * PER_HEAD)
    assert healthy.decode_reads_in_place()
    with torch.inference_mode():  # the model's tensors, as the engine makes them
        queries = torch.zeros(2, HEADS, PER_HEAD, DIM)
        assert broken.decode_attention(0, queries, tables, None, None, None, mask, 1.0) is None
        assert healthy.decode_attention(0, queries, tables, None, None, None, mask, 1.0) is not None


def test_a_batch_with_its_long_contexts_together_is_balanced_over_the_threads():
    ascending = [2 + i for i in range(16)]  # a running batch's contexts, sorted as admission order sorts them
    for heads, threads in [(3, 2), (2, 4), (1, 3)]:
        order = thread_balanced_order(ascending, heads, threads)
        assert sorted(order) == list(range(16))
        before, after = thread_shares(ascending, heads, threads), thread_shares([ascending[r] for r in order], heads,
                                                                                threads)
        assert max(after) < max(before) / 1.1
        if 16 % threads == 0:  # shares of as many requests each: as good as even
            assert max(after) < 1.1 * min(after)
        share = -(-16 * heads // threads)  # each thread's requests stay in their given order
        firsts = [[r for p, r in enumerate(order) if p * heads // share == t] for t in range(threads)]
        assert all(requests == sorted(requests) for requests in firsts)
    assert thread_balanced_order([5, 6, 5, 6, 6, 5, 5, 6], 3, 2) is None  # as good as it gets already
    assert thread_balanced_order(ascending, 3, 1) is None and thread_balanced_order([4], 3, 2) is None
    assert thread_shares([4, 8], 2, 2) == [6.0, 10.0]  # request 0's two items on thread 0, request 1's on thread 1


def test_a_reordered_step_reads_each_request_as_its_given_order_does(monkeypatch):
    cache = filled_cache(40)
    cache.warm_up(num_query_heads=HEADS * PER_HEAD)
    orders = []
    balanced = thread_balanced_order
    monkeypatch.setattr(flex_decode, "thread_balanced_order", lambda *a: orders.append(balanced(*a)) or orders[-1])
    g = torch.Generator().manual_seed(4)
    S, B = 8, 9
    tables = torch.stack([torch.randperm(40, generator=g)[:B] for _ in range(S)])
    mask = torch.arange(B * BS)[None, None, None, :] < (torch.arange(S) * BS + 3)[:, None, None, None]  # ascending
    with torch.inference_mode():
        queries = torch.randn(S, HEADS, PER_HEAD, DIM, generator=g)
        for threads, reordered in [(2, True), (1, False)]:
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            cache.begin_step([], [], [torch.zeros(S, dtype=torch.long)])
            out = cache.decode_attention(0, queries, tables, None, None, None, mask, 0.3)
            assert (orders[-1] is not None) == reordered
            if reordered:
                first = out
            else:
                assert torch.equal(out, first)  # bitwise: each request is read alike in either order
        torch.testing.assert_close(first, eager(cache, 0, queries, tables, mask, 0.3), atol=2e-6, rtol=2e-5)
