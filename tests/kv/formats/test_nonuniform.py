"""Non-uniform 4- and 3-bit KV storage (nuq4, nuq3, nuq3k4v): the values' codebook is a fixed function of head size
and bits; codes pack and unpack losslessly; keys read back within half a step of their channel's grid over the block, an
outlier channel included, values within the codebook's error; the filling block stays exact in staging until it
fills, and a block's bytes do not depend on how its tokens arrived; copies and exported blocks are bitwise; the
rotated copy of the staging follows the exact one; the compiled decode attention over the codes equals attention
over the eager read, and the compiled block store stores the eager one's bytes."""
import pytest
import torch
import torch.nn.functional as F

from kvserve import saved_graphs
from kvserve.config import CacheConfig
from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats.codebook import (NearestLevel, check_packable, codebook, levels_of, lloyd_max_levels, pack,
                                         packed_rows, unpack)
from kvserve.kv.formats.nonuniform import LOG_STEPS, NonUniformKVCache, decode_half_range, encode_half_range
from kvserve.planner.layout import KVLayout
from kvserve.rotation import hadamard

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 8, 8, 2, 64
FORMATS = ["nuq4", "nuq3", "nuq3k4v"]


def make(fmt: str, compile: bool = False) -> NonUniformKVCache:
    return make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(LAYERS), BLOCKS, BS, HEADS, DIM, torch.float32,
                                     max_num_seqs=2, compile=compile))


def vectors(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEADS, DIM, generator=g)
    x[:, :, 3] = x[:, :, 3] * 20 + 30  # an outlier channel with an offset, as keys have
    return x


def slots(block: int, start: int = 0, stop: int = BS) -> list[int]:
    return list(range(block * BS + start, block * BS + stop))


def write(cache, slots: list[int], k: torch.Tensor, v: torch.Tensor, copies=(), freed=()) -> None:
    cache.begin_step(list(freed), list(copies), [torch.tensor(slots, dtype=torch.long)])
    for layer in range(LAYERS):
        cache.write(layer, k * (layer + 1), v * (layer + 1))


@pytest.mark.parametrize("bits", [3, 4])
def test_the_codebook_is_symmetric_deterministic_and_its_cells_hold_their_means(bits):
    levels = torch.tensor(lloyd_max_levels(DIM, bits), dtype=torch.float64)
    lloyd_max_levels.cache_clear()
    assert torch.equal(levels, torch.tensor(lloyd_max_levels(DIM, bits), dtype=torch.float64))  # recomputed alike
    assert len(levels) == 2**bits and bool((levels.diff() > 0).all())
    assert torch.equal(levels, -levels.flip(0))
    # each level is the mean of the coordinates its cell takes (Lloyd's condition), on the coordinates of random
    # rotated unit vectors scaled to radius sqrt(dim)
    x = F.normalize(torch.randn(20_000, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64), dim=-1)
    x = (x * DIM**0.5).flatten()
    cells = torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)
    means = torch.stack([x[cells == i].mean() for i in range(2**bits)])
    assert torch.allclose(means, levels, atol=0.02)
    read, midpoints, coefficients = codebook(DIM, bits)
    assert torch.allclose(read.double(), levels, rtol=0, atol=1e-6)  # the polynomial read hits every level
    assert torch.equal(levels_of(torch.arange(2**bits, dtype=torch.uint8), coefficients, bits), read)
    assert torch.equal(midpoints, (read[1:] + read[:-1]) / 2) and len(coefficients) == 2 ** (bits - 1)


@pytest.mark.parametrize("bits", [3, 4])
def test_the_nearest_level_table_gives_bucketizes_codes_at_and_beside_every_midpoint(bits):
    """NearestLevel replaces torch.bucketize(x, midpoints): the same code for every value, the midpoints themselves
    and their float32 neighbours included (where a cell's rounding could go wrong), and for values far outside."""
    midpoints = codebook(DIM, bits)[1]
    nearest = NearestLevel(midpoints)
    g = torch.Generator().manual_seed(0)
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    x = torch.cat([torch.randn(20_000, generator=g) * 2, midpoints, torch.nextafter(midpoints, up),
                   torch.nextafter(midpoints, down), torch.linspace(-4, 4, 100_001), torch.tensor([1e30, -1e30]),
                   torch.stack([up, down])])
    codes = nearest(x)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes.long(), torch.bucketize(x, midpoints))
    assert int(nearest(torch.tensor([float("nan")]))) == 0  # a code within range, not a stray byte in the packing


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("block_size", [8, 16])
def test_a_blocks_codes_pack_into_block_size_times_bits_over_8_rows_and_back(bits, block_size):
    codes = torch.randint(0, 2**bits, (5, block_size, HEADS, DIM), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    packed = pack(codes, bits)
    assert packed.shape == (5, packed_rows(block_size, bits), HEADS, DIM) == (5, block_size * bits // 8, HEADS, DIM)
    assert torch.equal(unpack(packed, bits), codes)
    # each row of bytes holds whole channels: changing one token's code changes only its channel's bytes
    changed = codes.clone()
    changed[2, block_size - 1, 1, 7] ^= 1
    differs = (pack(changed, bits) != packed).nonzero().tolist()
    assert differs and all(index[0] == 2 and index[2:] == [1, 7] for index in differs)


def test_a_block_size_the_planes_cannot_split_is_refused_by_name():
    check_packable(8, 3)
    check_packable(2, 4)
    with pytest.raises(ValueError, match="block_size 4 must be a multiple of 8"):
        check_packable(4, 3)
    with pytest.raises(ValueError, match="nuq3.*block_size"):
        make_kv_cache(KVCacheSpec("nuq3", KVLayout.uniform(1), 4, 4, HEADS, DIM, torch.float32))


def test_three_bit_keys_with_four_bit_values_store_nuq4s_values_and_nuq3s_keys():
    k, v = vectors(BS), vectors(BS, seed=1)
    caches = {fmt: make(fmt) for fmt in FORMATS}
    for cache in caches.values():
        write(cache, slots(1), k, v)
    mixed = caches["nuq3k4v"]
    assert (mixed.key_bits, mixed.value_bits, mixed.k_scale.dtype) == (3, 4, torch.int8)
    assert torch.equal(mixed.v, caches["nuq4"].v) and torch.equal(mixed.v_scale, caches["nuq4"].v_scale)
    for name in ("k", "k_offset", "k_scale"):  # nuq3's keys, its one-byte half range included
        assert torch.equal(getattr(mixed, name), getattr(caches["nuq3"], name))
    keys = {fmt: float((c.gather(0, torch.tensor([[1]]))[0][0] - k).pow(2).mean()) for fmt, c in caches.items()}
    values = {fmt: float((c.gather(0, torch.tensor([[1]]))[1][0] - v).pow(2).mean()) for fmt, c in caches.items()}
    assert keys["nuq4"] < keys["nuq3k4v"] / 2 and values["nuq3k4v"] < values["nuq3"] / 2  # 16 levels where 8


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_engine_config_refuses_exactly_the_block_sizes_the_cache_cannot_pack(fmt):
    """CacheConfig refuses a block size before any model loads (from the planner's KVDtype); the cache refuses
    the same ones when built directly: the two rules must agree."""
    for block_size in range(1, 33):
        try:
            CacheConfig(kv_cache_dtype=fmt, block_size=block_size, kv_cache_memory=None, enable_prefix_caching=True)
            config_takes = True
        except ValueError:
            config_takes = False
        try:
            make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(1), 2, block_size, HEADS, DIM, torch.float32,
                                      compile=False))
            cache_takes = True
        except ValueError:
            cache_takes = False
        assert config_takes == cache_takes, block_size


def test_the_basis_is_a_fixed_orthonormal_matrix_and_reads_are_rotated_back():
    cache = make("nuq4")
    assert torch.equal(cache.basis, make("nuq3").basis) and torch.equal(cache.basis, hadamard(DIM))
    assert torch.allclose(cache.basis @ cache.basis.T, torch.eye(DIM), atol=1e-6)
    assert cache.rotation is None  # gather returns K and V as written, for attention to join the staged tokens


def test_a_one_byte_half_range_is_within_a_thirty_second_octave_and_saturates():
    half = torch.tensor([1e-3, 0.01, 0.37, 1.0, 6.0, 200.0, 1e4])
    stored = encode_half_range(half, torch.int8)
    assert stored.dtype == torch.int8
    back = decode_half_range(stored)
    inside = (half >= 2**-8) & (half <= 2 ** (127 / LOG_STEPS))
    assert ((back[inside] / half[inside]).log2().abs() <= 0.5 / LOG_STEPS + 1e-6).all()
    assert back[0] == 2**-8 and back[-1] == 2 ** (127 / LOG_STEPS)  # saturated at both ends
    assert torch.equal(decode_half_range(encode_half_range(half, torch.float16)), half.half().float())


def _key_error_bound(cache: NonUniformKVCache, x: torch.Tensor) -> torch.Tensor:
    """Per (head, channel) of one block [BS, heads, dim] in the stored basis: half a grid step of its range, with the
    stored half range's rounding and the midpoint's refit (which moves each token by the mean rounding error)."""
    rotated = x @ cache.basis
    half = (rotated.amax(0) - rotated.amin(0)) / 2
    step = 2 * half / (2**cache.key_bits - 1)
    # half a step, twice (rounding, then the refit), the range rounded by <= 2.2%, the float16 midpoint's rounding
    return step + 0.05 * half + rotated.mean(0).abs() * 2**-10 + 1e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_keys_read_back_within_their_channels_grid_and_values_within_the_codebooks_error(fmt):
    cache = make(fmt)
    k, v = vectors(BS), vectors(BS, seed=1)
    write(cache, slots(1), k, v)  # block 1, filled in one step
    got_k, got_v = cache.gather(1, torch.tensor([[1]]))
    error = ((got_k[0] - 2 * k) @ cache.basis).abs()  # in the stored basis, where each channel has its grid
    assert bool((error <= _key_error_bound(cache, 2 * k)).all())
    relative = (got_v[0] - 2 * v).pow(2).sum(-1) / (2 * v).pow(2).sum(-1)
    max_relative = {4: 0.012, 3: 0.045}[cache.value_bits]  # measured when written: 0.0080 (4 bits) and 0.030 (3)
    assert float(relative.mean()) <= max_relative and bool((relative < 4 * max_relative).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_stored_code_is_its_values_nearest_level(fmt):
    """Keys round onto their channel's even grid and values take the codebook's nearest level: the stored code of
    each is the one whose level is closest (a tie either way), as a search over the levels would choose."""
    cache = make(fmt)
    k, v = vectors(BS).view(1, BS, HEADS, DIM), vectors(BS, seed=1).view(1, BS, HEADS, DIM)
    codes, offset, scale = cache.quantize_keys(k)
    x = cache.rotate(k.flatten(0, 1)).view(k.shape)
    half = decode_half_range(scale).view(1, 1, HEADS, DIM)
    grid = torch.linspace(-1, 1, 2**cache.key_bits)
    y = (x - ((x.amax(1) + x.amin(1)) / 2)[:, None]) / half  # the block's channels on -1 ... 1
    _assert_nearest(unpack(codes, cache.key_bits).long(), y, grid)
    codes, scale = cache.quantize_values(v)
    x = cache.rotate(v.flatten(0, 1)).view(v.shape)
    first = x.abs().amax(-1) / cache.value_levels[-1] if cache.value_bits >= 4 else x.norm(dim=-1) / DIM**0.5
    _assert_nearest(unpack(codes, cache.value_bits).long(), x / first[..., None], cache.value_levels)


def _assert_nearest(codes: torch.Tensor, y: torch.Tensor, levels: torch.Tensor) -> None:
    distance = (y[..., None] - levels).abs()
    chosen = distance.gather(-1, codes[..., None]).squeeze(-1)
    assert bool((chosen <= distance.amin(-1) + 1e-5).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_outlier_channel_costs_the_other_keys_nothing(fmt):
    """Statistics per channel: a channel with a large offset and range leaves every other channel's codes as
    they were (in the stored basis, where statistics are kept, the outlier is one channel of its own)."""
    # dyadic values: rotating them (entries of +-1/8) is exact, so the stored basis holds exactly `stored`
    stored = torch.randint(-16, 17, (BS, HEADS, DIM), generator=torch.Generator().manual_seed(4)) / 8
    spiked = stored.clone()
    spiked[:, :, 5] = spiked[:, :, 5] * 40 + 300
    plain, with_outlier = stored @ hadamard(DIM).T, spiked @ hadamard(DIM).T
    caches = []
    for k in (plain, with_outlier):
        caches.append(make(fmt))
        write(caches[-1], slots(1), k, k)
    codes = [unpack(c._blocks_view(c.k, 0)[1], c.key_bits) for c in caches]
    others = torch.arange(DIM) != 5
    assert torch.equal(codes[0][..., others], codes[1][..., others])
    got = caches[1].gather(0, torch.tensor([[1]]))[0][0]
    error = ((got - with_outlier) @ caches[1].basis).abs()
    assert bool((error <= _key_error_bound(caches[1], with_outlier)).all())  # the outlier channel too


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_filling_block_stays_exact_in_staging_until_it_fills(fmt):
    cache = make(fmt)
    k, v = vectors(BS), vectors(BS, seed=1)
    write(cache, slots(2, 0, 2), k[:2], v[:2])  # block 2, offsets 0-1: staged
    staged_k, staged_v = cache.gather_residual(0, torch.tensor([2]))
    assert torch.equal(staged_k[0, :2], k[:2]) and torch.equal(staged_v[0, :2], v[:2])
    assert not cache.k.any() and not cache.k_offset.any()  # nothing quantized yet
    write(cache, slots(2, 2), k[2:], v[2:])  # fills it: quantized from the staged tokens and the new ones
    one_step = make(fmt)
    write(one_step, slots(2), k, v)
    assert all(torch.equal(a, b) for a, b in zip(cache._block_tensors(), one_step._block_tensors()))
    write(cache, [], k[:0], v[:0])  # the next step releases the filled block's staging row
    assert int(cache.row_of_block[2]) == -1


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_blocks_statistics_depend_on_its_tokens_alone(fmt):
    k, v = vectors(3 * BS), vectors(3 * BS, seed=1)
    together, alone = make(fmt), make(fmt)
    write(together, list(range(BS, 4 * BS)), k, v)  # blocks 1-3 in one step
    write(alone, slots(3), k[2 * BS:], v[2 * BS:])  # block 3 by itself
    for a, b in zip(together.export_block(3), alone.export_block(3)):
        assert torch.equal(a, b)
    again = make(fmt)
    write(again, slots(3), k[2 * BS:], v[2 * BS:])
    assert all(torch.equal(a, b) for a, b in zip(again.export_block(3), alone.export_block(3)))  # deterministic


@pytest.mark.parametrize("fmt", FORMATS)
def test_copies_follow_staging_and_exported_blocks_are_bitwise(fmt):
    k, v = vectors(BS + 2), vectors(BS + 2, seed=1)
    cache = make(fmt)
    write(cache, slots(1) + slots(2, 0, 1), k[:BS + 1], v[:BS + 1])  # block 1 full, block 2 holds one token
    write(cache, slots(5, 1, 2), k[BS + 1:], v[BS + 1:], copies=[(2, 5)])  # copy-on-write of block 2, then offset 1
    copy_k, _ = cache.gather_residual(0, torch.tensor([5]))
    assert torch.equal(copy_k[0, 0], k[BS]) and torch.equal(copy_k[0, 1], k[BS + 1])
    assert not cache.gather_residual(0, torch.tensor([2]))[0][0, 1].any()  # the original is untouched
    write(cache, [], k[:0], v[:0], copies=[(1, 6)])  # a full block: its bytes
    assert all(torch.equal(a, b) for a, b in zip(cache.export_block(6), cache.export_block(1)))
    other = make(fmt)
    other.import_block(0, cache.export_block(1))
    assert torch.equal(other.gather(0, torch.tensor([[0]]))[0], cache.gather(0, torch.tensor([[1]]))[0])
    key_scale = torch.float16 if fmt == "nuq4" else torch.int8
    assert [s[0] for s in cache.block_specs()] == [torch.uint8, torch.uint8, torch.float16, key_scale, torch.float16]
    write(cache, [], k[:0], v[:0], freed=[5, 2])
    assert int(cache.row_of_block[5]) == int(cache.row_of_block[2]) == -1


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_rotated_staging_follows_the_exact_one_through_writes_copies_and_growth(fmt):
    cache, eager = make(fmt, compile=True), make(fmt)
    assert eager.rotated_k is None and cache.rotated_k is not None  # kept only for the compiled decode attention
    assert "kept also rotated" in cache.describe() and "kept also rotated" not in eager.describe()
    k, v = vectors(12), vectors(12, seed=1)
    write(cache, [slot for block in range(6) for slot in slots(block, 0, 2)], k, v)  # 6 partial blocks: 4 rows grow
    write(cache, slots(7, 2, 3), k[:1], v[:1], copies=[(3, 7)])  # copy-on-write of block 3, then offset 2
    assert cache.staging_rows == 8 and cache.extra_nbytes == 2 * (cache.staging_k.nbytes + cache.staging_v.nbytes)
    for exact, rotated in ((cache.staging_k, cache.rotated_k), (cache.staging_v, cache.rotated_v)):
        assert exact.any() and torch.allclose(rotated, exact @ cache.basis, atol=1e-5)
    rows = torch.tensor([3, 7])
    assert torch.allclose(cache._staged(1, rows, rotated=True)[0], cache._staged(1, rows)[0] @ cache.basis, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_decode_attention_that_failed_to_compile_leaves_no_rotated_staging(fmt, monkeypatch):
    """Only the compiled decode attention reads the rotated staging: where compiling it fails at warm-up, the cache
    stops keeping it (its memory freed, writes no longer rotate) and attends eagerly over the exact staging."""
    cache = make(fmt, compile=True)

    def fails(*args, **kwargs):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})  # compiled here, not an earlier test's kernel
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", fails)
        cache.warm_up(num_query_heads=HEADS * 2)
    assert cache.fused_decode.failed is not None
    assert cache.rotated_k is None and cache.rotated_v is None and "kept also rotated" not in cache.describe()
    assert cache.extra_nbytes == cache.staging_k.nbytes + cache.staging_v.nbytes
    write(cache, slots(2, 0, 3), vectors(3), vectors(3, seed=1), copies=[(2, 4)])  # writes and copies: exact only
    assert cache.staging_k.any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_decode_attention_over_codes_equals_attention_over_the_eager_read(fmt):
    cache = make(fmt, compile=True)
    assert cache.fused_decode is not None
    cache.warm_up(num_query_heads=HEADS * 2)
    write(cache, list(range(BS, BS + 5 * BS + 2)), vectors(5 * BS + 2), vectors(5 * BS + 2, seed=1))
    tables = torch.tensor([[1, 2, 3, 4, 5], [3, 1, 0, 0, 0]])
    own = torch.tensor([6, -1])  # block 6 holds 2 staged tokens
    mask = torch.zeros(2, 1, 1, 6 * BS + 1, dtype=torch.bool)
    mask[0, ..., : 5 * BS], mask[0, ..., 5 * BS: 5 * BS + 2], mask[1, ..., : 2 * BS + 1] = True, True, True
    mask[..., -1] = True
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():  # as the model makes them (the kernel's graphs take what its warm-up made)
        queries = torch.randn(2, HEADS, 2, DIM, generator=g)
        new_k, new_v = torch.randn(2, 1, HEADS, DIM, generator=g), torch.randn(2, 1, HEADS, DIM, generator=g)
        out = cache.decode_attention(1, queries, tables, own, new_k, new_v, mask, DIM**-0.5)
        keys, values = cache.gather_with_own_block(1, tables, own, new_k, new_v)
        expected = F.scaled_dot_product_attention(
            queries.reshape(2, HEADS * 2, 1, DIM), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=DIM**-0.5, enable_gqa=True).view(2, HEADS, 2, DIM)
    assert cache.fused_decode.failed is None
    assert out.shape == expected.shape
    # float32 rounding of different orders of sums (and the rotations), on outputs as large as the outlier's 60
    assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_compiled_block_store_stores_the_eager_stores_bytes(fmt):
    compiled, eager = make(fmt, compile=True), make(fmt)
    compiled.warm_up(num_query_heads=HEADS * 2)
    k, v = vectors(7 * BS, seed=5), vectors(7 * BS, seed=6) * 3
    with torch.inference_mode():  # as the model writes
        for cache in (compiled, eager):
            write(cache, list(range(BS, 2 * BS)), k[:BS], v[:BS])  # one block, then six in one step
            write(cache, list(range(2 * BS, 8 * BS)), k[BS:], v[BS:])
    store = compiled.compiled_store
    assert store.failed is None and not store._misses and store.graphs_compiled + store.graphs_loaded == 1
    # the same arithmetic; sums over a block or a vector may run in another order (the generated loops' vectors):
    # a code may then differ at a rounding tie, a stored float16 by one unit (bitwise equal on the Xeon measured)
    for got, expected in zip(compiled._block_tensors(), eager._block_tensors()):
        if got.dtype == torch.uint8:
            assert (got != expected).float().mean() < 0.01
        else:
            torch.testing.assert_close(got.float(), expected.float(), rtol=1e-3, atol=0)
