"""INT4 (KIVI) KV storage: keys quantized per channel over a full block, values per token, both within half a
quantization step; a partly filled block stays in full precision in staging until it fills; staging follows
copy-on-write and is released when its block is freed."""
import torch

from kvserve.kv.formats.int4 import Int4KVCache, pack, unpack_into
from kvserve.planner.layout import KVLayout

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 6, 4, 2, 8


def make(max_num_seqs: int = 2) -> Int4KVCache:
    return Int4KVCache(KVLayout.uniform(LAYERS), BLOCKS, BS, HEADS, DIM, dtype=torch.float32,
                       max_num_seqs=max_num_seqs)


def step(cache: Int4KVCache, slots: list[int], k: torch.Tensor, v: torch.Tensor, freed=(), copies=()) -> None:
    cache.begin_step(list(freed), list(copies), [torch.tensor(slots, dtype=torch.long)])
    for layer in range(LAYERS):
        cache.write(layer, k * (layer + 1), v * (layer + 1))


def vectors(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEADS, DIM, generator=g)
    x[:, :, 2] = x[:, :, 2] * 30 + 50  # an outlier channel with an offset, as keys have
    return x


def test_pack_and_unpack_are_inverse():
    codes = torch.randint(0, 16, (3, BS, HEADS, DIM), dtype=torch.uint8)
    assert pack(codes).shape == (3, BS // 2, HEADS, DIM)
    widened = torch.empty(3, BS, HEADS, DIM)
    unpack_into(widened, pack(codes))
    assert torch.equal(widened, codes.float())


def test_a_full_block_reads_back_within_half_a_step_per_key_channel_and_per_value_token():
    cache = make()
    k, v = vectors(BS), vectors(BS, seed=1)
    step(cache, [4, 5, 6, 7], k, v)  # block 1, filled in one step
    got_k, got_v = cache.gather(1, torch.tensor([[1]]))
    key_step = (2 * k).amax(dim=0) - (2 * k).amin(dim=0)  # per (head, channel) over the block's tokens
    value_step = (2 * v).amax(dim=-1) - (2 * v).amin(dim=-1)  # per (token, head)
    assert ((got_k[0] - 2 * k).abs() <= key_step / 15 / 2 * 1.01 + 1e-3).all()
    assert ((got_v[0] - 2 * v).abs() <= value_step[..., None] / 15 / 2 * 1.01 + 1e-3).all()


def test_a_partly_filled_block_stays_exact_in_staging_until_it_fills():
    cache = make()
    k, v = vectors(BS), vectors(BS, seed=1)
    step(cache, [8, 9], k[:2], v[:2])  # block 2, offsets 0-1: staged
    staged_k, staged_v = cache.gather_residual(0, torch.tensor([2]))
    assert torch.equal(staged_k[0, :2], k[:2]) and torch.equal(staged_v[0, :2], v[:2])
    assert not cache.k.any()  # nothing quantized yet
    step(cache, [10, 11], k[2:], v[2:])  # fills it: quantized from the staged tokens and the new ones
    full_k, _ = cache.gather(0, torch.tensor([[2]]))
    one_step = make()
    step(one_step, [8, 9, 10, 11], k, v)
    assert torch.equal(full_k, one_step.gather(0, torch.tensor([[2]]))[0])
    step(cache, [], k[:0], v[:0])  # the next step releases the filled block's staging row
    assert int(cache.row_of_block[2]) == -1


def test_copy_on_write_copies_staging_and_freeing_releases_it():
    cache = make(max_num_seqs=1)
    assert cache.staging_rows == 2  # two rows per sequence
    k, v = vectors(3), vectors(3, seed=1)
    step(cache, [0, 1], k[:2], v[:2])  # block 0 partly filled
    step(cache, [22], k[2:], v[2:], copies=[(0, 5)])  # the fork's copy of block 0 gets its own token at offset 2
    copy_k, _ = cache.gather_residual(0, torch.tensor([5]))
    assert torch.equal(copy_k[0, :2], k[:2]) and torch.equal(copy_k[0, 2], k[2])
    original_k, _ = cache.gather_residual(0, torch.tensor([0]))
    assert not original_k[0, 2].any()  # the original block is untouched
    step(cache, [16], k[:1], v[:1])  # a third partly filled block: staging grows
    assert cache.staging_rows == 4
    step(cache, [], k[:0], v[:0], freed=[0, 5, 4])
    assert int(cache.row_of_block[0]) == int(cache.row_of_block[5]) == int(cache.row_of_block[4]) == -1
    assert sorted(cache._free_rows) == [0, 1, 2, 3]


def test_no_staging_row_reads_as_zeros_for_masking():
    cache = make()
    staged_k, staged_v = cache.gather_residual(0, torch.tensor([-1, 3]))
    assert staged_k.shape == (2, BS, HEADS, DIM) and not staged_k.any() and not staged_v.any()


def test_storage_matches_the_kivi_layout():
    cache = make()
    tokens = BLOCKS * BS
    data = 2 * LAYERS * tokens * HEADS * DIM // 2
    key_scales = LAYERS * BLOCKS * HEADS * DIM * (2 + 2)
    value_scales = LAYERS * tokens * HEADS * (2 + 2)
    assert cache.nbytes == data + key_scales + value_scales
    assert cache.extra_nbytes == 4 * 2 * LAYERS * BS * HEADS * DIM * 4  # 2 rows x 2 sequences, K and V, float32


def test_a_chunk_that_completes_a_block_and_starts_the_next_needs_no_growth():
    cache = make(max_num_seqs=2)
    k, v = vectors(10), vectors(10, seed=1)
    step(cache, [0, 1], k[:2], v[:2])  # sequence A: block 0 partly filled
    step(cache, [8, 9], k[:2], v[:2])  # sequence B: block 2 partly filled
    step(cache, [2, 3, 4, 10, 11, 12, 13, 14, 15, 20], k, v)  # A completes 0, starts 1; B fills 2 and 3, starts 5
    assert cache.staging_rows == 4
    assert torch.equal(cache.gather_residual(0, torch.tensor([1, 5]))[0][:, 0], k[[2, 9]])


def test_a_read_with_the_own_block_is_blocks_then_staged_then_new_tokens():
    cache = make()
    k, v = vectors(BS + 2), vectors(BS + 2, seed=1)
    step(cache, [4, 5, 6, 7, 8, 9], k, v)  # block 1 full (quantized), block 2 with two staged tokens
    new_k, new_v = vectors(1, seed=2)[None], vectors(1, seed=3)[None]
    keys, values = cache.gather_with_own_block(0, torch.tensor([[1]]), torch.tensor([2]), new_k, new_v)
    blocks_k, blocks_v = cache.gather(0, torch.tensor([[1]]))
    staged_k, staged_v = cache.gather_residual(0, torch.tensor([2]))
    assert torch.equal(keys, torch.cat([blocks_k, staged_k, new_k], dim=1))
    assert torch.equal(values, torch.cat([blocks_v, staged_v, new_v], dim=1))
    assert torch.equal(keys[0, BS:BS + 2], k[BS:])  # the staged tokens are exact


def test_unpack_reads_every_byte_as_its_two_nibbles():
    packed = torch.arange(256, dtype=torch.uint8).view(4, 2, 2, 16)  # [blocks, block_size / 2, heads, dim]
    widened = torch.empty(4, 4, 2, 16)
    unpack_into(widened, packed)
    assert torch.equal(widened[:, :2], (packed & 0x0F).float())  # low nibbles: the block's first half
    assert torch.equal(widened[:, 2:], (packed >> 4).float())
