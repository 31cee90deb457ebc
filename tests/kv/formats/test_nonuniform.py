"""Non-uniform 4- and 3-bit KV storage (nuq4, nuq3): the codebook is a fixed function of head size and bits;
codes pack and unpack losslessly; a vector reads back within its nearest-level error; every slot's bytes are its
token's alone (copy-on-write copies and exported blocks are bitwise); the compiled decode attention over the codes
equals attention over the dequantized K/V."""
import pytest
import torch
import torch.nn.functional as F

from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats.codebook import codebook, lloyd_max_levels, pack, packed_bytes, unpack
from kvserve.kv.formats.nonuniform import NonUniformKVCache
from kvserve.planner.layout import KVLayout
from kvserve.rotation import hadamard

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 8, 4, 2, 64


def make(fmt: str, compile: bool = False) -> NonUniformKVCache:
    return make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(LAYERS), BLOCKS, BS, HEADS, DIM, torch.float32,
                                     compile=compile))


def vectors(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEADS, DIM, generator=g)
    x[:, :, 3] = x[:, :, 3] * 20 + 30  # an outlier channel with an offset, as keys have
    return x


def write(cache, slots: list[int], k: torch.Tensor, v: torch.Tensor, copies=()) -> None:
    cache.begin_step([], list(copies), [torch.tensor(slots, dtype=torch.long)])
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
    assert torch.equal(codebook(DIM, bits)[0], levels.float())


@pytest.mark.parametrize("bits", [3, 4])
def test_codes_pack_into_dim_times_bits_over_8_bytes_and_back(bits):
    codes = torch.randint(0, 2**bits, (5, HEADS, DIM), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack(codes, bits)
    assert packed.shape == (5, HEADS, packed_bytes(DIM, bits)) == (5, HEADS, DIM * bits // 8)
    assert torch.equal(unpack(packed, bits, DIM), codes)


def test_the_rotation_is_a_fixed_orthonormal_matrix():
    rotation = make("nuq4").rotation
    assert torch.equal(rotation, make("nuq3").rotation) and torch.equal(rotation, hadamard(DIM))
    assert torch.allclose(rotation @ rotation.T, torch.eye(DIM), atol=1e-6)


# relative squared error of a read, measured on these vectors when written (nuq4 0.0080, nuq3 0.030), with room
MAX_RELATIVE_ERROR = {"nuq4": 0.012, "nuq3": 0.045}


@pytest.mark.parametrize("fmt", ["nuq4", "nuq3"])
def test_a_vector_reads_back_rotated_within_the_codebooks_error(fmt):
    cache = make(fmt)
    k, v = vectors(BS), vectors(BS, seed=1)
    write(cache, [4, 5, 6, 7], k, v)
    got_k, got_v = cache.gather(1, torch.tensor([[1]]))
    rotation = cache.rotation
    for got, x in ((got_k[0] @ rotation.T, 2 * k), (got_v[0] @ rotation.T, 2 * v)):
        relative = ((got - x).pow(2).sum(-1) / x.pow(2).sum(-1))
        assert float(relative.mean()) <= MAX_RELATIVE_ERROR[fmt]
        assert bool((relative < 4 * MAX_RELATIVE_ERROR[fmt]).all())


@pytest.mark.parametrize("fmt", ["nuq4", "nuq3"])
def test_slots_hold_their_own_token_alone_and_copies_and_exports_are_bitwise(fmt):
    k, v = vectors(6), vectors(6, seed=1)
    whole, split = make(fmt), make(fmt)
    write(whole, [4, 5, 6, 7, 8, 9], k, v)
    write(split, [4, 5, 6], k[:3], v[:3])  # the same tokens in two steps: the same bytes
    write(split, [7, 8, 9], k[3:], v[3:])
    assert all(torch.equal(a, b) for a, b in zip(whole._block_tensors(), split._block_tensors()))
    write(split, [], k[:0], v[:0], copies=[(2, 5)])  # copy-on-write of the partly filled block 2
    assert all(torch.equal(a, b) for a, b in zip(split.export_block(5), whole.export_block(2)))
    other = make(fmt)
    other.import_block(0, whole.export_block(1))
    assert torch.equal(other.gather(0, torch.tensor([[0]]))[0], whole.gather(0, torch.tensor([[1]]))[0])
    assert [spec[0] for spec in whole.block_specs()] == [torch.uint8, torch.uint8, torch.float16, torch.float16]


@pytest.mark.parametrize("fmt", ["nuq4", "nuq3"])
def test_compiled_decode_attention_over_codes_equals_attention_over_the_dequantized_cache(fmt):
    cache = make(fmt, compile=True)
    assert cache.fused_decode is not None
    write(cache, list(range(4, 4 + 5 * BS)), vectors(5 * BS), vectors(5 * BS, seed=1))
    tables = torch.tensor([[1, 2, 3, 4, 5], [3, 1, 0, 0, 0]])
    mask = torch.zeros(2, 1, 1, 5 * BS, dtype=torch.bool)
    mask[0, ..., : 5 * BS - 1], mask[1, ..., : 2 * BS + 1] = True, True
    queries = torch.randn(2, HEADS, 2, DIM, generator=torch.Generator().manual_seed(3))
    new = torch.zeros(2, 1, HEADS, DIM)
    with torch.inference_mode():
        out = cache.decode_attention(1, queries, tables, None, new, new, mask, DIM**-0.5)
        keys, values = cache.gather(1, tables)  # rotated: attend with rotated queries, rotate the output back
        expected = F.scaled_dot_product_attention(
            queries.reshape(2, HEADS * 2, 1, DIM) @ cache.rotation, keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=DIM**-0.5, enable_gqa=True).view(2, HEADS, 2, DIM) @ cache.rotation.T
    assert cache.fused_decode.failed is None
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-4)
