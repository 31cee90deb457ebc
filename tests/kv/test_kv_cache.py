"""The paged KV store: what is written at any slots reads back unchanged, in its layer only, and copy_blocks
moves whole blocks of K and V in every layer; with several layer groups each layer reads and writes its own
group's slots in its own row of the blocks."""
import torch

from kvserve.kv.kv_cache import FullPrecisionKVCache
from kvserve.planner.layout import KVLayout

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 4, 2, 5


def make_cache(dtype=torch.float32, storage_dtype=None) -> FullPrecisionKVCache:
    return FullPrecisionKVCache(KVLayout.uniform(LAYERS), BLOCKS, BS, HEADS, DIM, dtype=dtype,
                                storage_dtype=storage_dtype)


def write(cache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    cache.begin_step([], [], [slots] * cache.layout.num_groups)
    cache.write(layer, k, v)


def test_write_then_gather_round_trips_at_arbitrary_slots():
    cache = make_cache()
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(BLOCKS * BS, generator=g)[:10]
    k = torch.randn(10, HEADS, DIM, generator=g)
    v = torch.randn(10, HEADS, DIM, generator=g)
    write(cache, 1, slots, k, v)

    tables = torch.tensor([[3, 0, 5], [1, 1, 4]])  # [S=2, B=3] block ids, repeats allowed
    got_k, got_v = cache.gather(1, tables)
    assert got_k.shape == got_v.shape == (2, 3 * BS, HEADS, DIM)
    written = dict(zip(slots.tolist(), range(10)))
    for s in range(2):
        for pos in range(3 * BS):
            slot = int(tables[s, pos // BS]) * BS + pos % BS
            want_k = k[written[slot]] if slot in written else torch.zeros(HEADS, DIM)
            want_v = v[written[slot]] if slot in written else torch.zeros(HEADS, DIM)
            assert torch.equal(got_k[s, pos], want_k) and torch.equal(got_v[s, pos], want_v)

    assert not cache.k[[0, 2]].any() and not cache.v[[0, 2]].any()  # other layers untouched


def test_write_overwrites_and_casts_to_the_cache_dtype():
    cache = make_cache(torch.float32, storage_dtype=torch.bfloat16)
    slots = torch.tensor([5, 17])  # block 1 offset 1, block 4 offset 1
    write(cache, 0, slots, torch.full((2, HEADS, DIM), 1.0), torch.full((2, HEADS, DIM), 2.0))
    write(cache, 0, slots[:1], torch.full((1, HEADS, DIM), 3.0), torch.full((1, HEADS, DIM), 4.0))
    assert cache.k.dtype == torch.bfloat16 and not cache.exact
    k, v = cache.gather(0, torch.tensor([[1, 4]]))
    assert k.dtype == torch.float32  # reads come back in the compute dtype
    assert k[0, [1, BS + 1], 0, 0].tolist() == [3.0, 1.0] and v[0, [1, BS + 1], 0, 0].tolist() == [4.0, 2.0]


def test_copy_blocks_copies_every_layer_of_k_and_v():
    cache = make_cache()
    g = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    before_k, before_v = cache.k.clone(), cache.v.clone()

    cache.copy_blocks([(1, 4), (2, 0)])

    def block(t, layer, b):
        return t[layer, b * BS : (b + 1) * BS]

    for layer in range(LAYERS):
        for src, dst in [(1, 4), (2, 0)]:
            assert torch.equal(block(cache.k, layer, dst), block(before_k, layer, src))
            assert torch.equal(block(cache.v, layer, dst), block(before_v, layer, src))
        for kept in (1, 2, 3, 5):
            assert torch.equal(block(cache.k, layer, kept), block(before_k, layer, kept))
            assert torch.equal(block(cache.v, layer, kept), block(before_v, layer, kept))


def test_copy_blocks_with_no_pairs_changes_nothing():
    cache = make_cache()
    cache.k.fill_(1.0)
    cache.copy_blocks([])
    assert bool((cache.k == 1.0).all()) and not cache.v.any()


def test_nbytes_counts_k_and_v_of_every_slot():
    assert make_cache().nbytes == 2 * LAYERS * BLOCKS * BS * HEADS * DIM * 4


def test_layers_of_two_groups_use_their_own_slots_and_rows():
    layout = KVLayout.from_layer_windows([8, 8, None, None])  # groups of 2 layers: sliding {0, 1}, full {2, 3}
    cache = FullPrecisionKVCache(layout, BLOCKS, BS, HEADS, DIM)
    assert cache.num_layers == 2 and layout.group_of == (0, 0, 1, 1) and layout.row_of == (0, 1, 0, 1)
    k = torch.randn(2, HEADS, DIM)
    cache.begin_step([], [], [torch.tensor([0, 1]), torch.tensor([8, 9])])  # group 0: block 0, group 1: block 2
    for layer in range(4):
        cache.write(layer, k * (layer + 1), -k)
    for layer, block in ((0, 0), (1, 0), (2, 2), (3, 2)):
        got, _ = cache.gather(layer, torch.tensor([[block]]))
        assert torch.equal(got[0, :2], k * (layer + 1))
