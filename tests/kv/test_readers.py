"""Each KV cache reads with the reader its format chose when the cache was built (kvserve/kv/readers.py): gathered
blocks and one scaled-dot-product call for every format, the format's compiled decode kernel for its decodes where
it has one (the gathered read where the kernel declines), and batch-invariant mode's tiles."""
import pytest
import torch
import torch.nn.functional as F

from kvserve import saved_graphs
from kvserve.batch_invariant import RowTiles
from kvserve.kv import readers
from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.kv_cache import LayerRow
from kvserve.kv.readers import AttentionGroup, DecodeKernelReader, GatherReader, TileReader
from kvserve.planner.layout import KVLayout

BS, BLOCKS, HEADS, PER_HEAD, DIM = 4, 8, 2, 2, 16


def filled(fmt: str, **options):
    """One layer, blocks 0..3 filled (16 tokens)."""
    cache = make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(1), BLOCKS, BS, HEADS, DIM, torch.float32, **options))
    g = torch.Generator().manual_seed(0)
    cache.begin_step([], [], [torch.arange(4 * BS)])
    cache.write(0, torch.randn(4 * BS, HEADS, DIM, generator=g), torch.randn(4 * BS, HEADS, DIM, generator=g))
    return cache


def decode_group() -> AttentionGroup:
    """Two requests of one query each over blocks [0, 1] (7 keys seen) and [2, 3] (all 8)."""
    mask = torch.arange(2 * BS).expand(2, 1, 1, -1) < torch.tensor([7, 8]).view(2, 1, 1, 1)
    return AttentionGroup(torch.tensor([[0], [1]]), torch.tensor([[0, 1], [2, 3]]), mask, None, None)


def new_tokens(n: int = 2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, HEADS * PER_HEAD, DIM, generator=g), torch.randn(n, HEADS, DIM, generator=g),
            torch.randn(n, HEADS, DIM, generator=g))


@pytest.mark.parametrize("fmt, options, reader", [
    ("float32", {}, GatherReader), ("bfloat16", {}, GatherReader), ("fp8_e4m3", {}, GatherReader),
    ("int8", {"compile": False}, GatherReader), ("int4", {"compile": False}, GatherReader),
    ("int8", {}, DecodeKernelReader), ("int4", {}, DecodeKernelReader),
    ("float32", {"decode_in_place": True}, DecodeKernelReader),
    ("float32", {"tiles": RowTiles(16)}, TileReader), ("int8", {"tiles": RowTiles(16)}, TileReader),
])
def test_a_cache_reads_with_the_reader_its_format_chose_when_built(fmt, options, reader):
    cache = make_kv_cache(KVCacheSpec(fmt, KVLayout.uniform(1), BLOCKS, BS, HEADS, DIM, torch.float32, **options))
    assert type(cache.reader) is reader and cache.reader.cache is cache


def test_gathered_decodes_equal_attention_over_the_gathered_keys():
    cache, group = filled("float32"), decode_group()
    q, k, v = new_tokens()
    out = cache.reader.attend(q, k, v, 0, [group], 0.25)
    keys, values = cache.gather(0, group.block_tables)
    expected = F.scaled_dot_product_attention(q[:, None].transpose(1, 2), keys.transpose(1, 2),
                                              values.transpose(1, 2), attn_mask=group.mask, scale=0.25,
                                              enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out, expected.reshape(q.shape), atol=1e-6)


def test_decodes_the_kernel_declines_are_read_as_gathered(monkeypatch):
    cache, group = filled("int8"), decode_group()

    def fails(*args, **kwargs):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})  # compiled here, not an earlier test's kernel
    monkeypatch.setattr(torch, "compile", fails)
    cache.warm_up(HEADS * PER_HEAD)
    q, k, v = new_tokens()
    out = cache.reader.attend(q, k, v, 0, [group], 0.25)
    assert cache.fused_decode.failed is not None
    assert torch.equal(out, GatherReader(cache).attend(q, k, v, 0, [group], 0.25))


def test_a_layers_row_reads_as_its_cache_reads_that_layer():
    cache, group = filled("float32"), decode_group()
    q, k, v = new_tokens()
    row = LayerRow(cache, torch.tensor(0), torch.tensor([30, 31]))
    assert type(row.reader) is GatherReader and row.reader.cache is row
    assert torch.equal(row.reader.attend(q, k, v, 0, [group], 0.5), cache.reader.attend(q, k, v, 0, [group], 0.5))


def test_groups_of_part_of_the_batch_land_on_their_tokens():
    """A batch of three tokens in two groups: each group's real rows go to its own tokens, its padding nowhere."""
    cache, mask = filled("float32"), decode_group().mask
    q, k, v = new_tokens(3)
    tables = torch.tensor([[0, 1], [2, 3]])
    first = AttentionGroup(torch.tensor([[0], [1]]), tables, mask, torch.tensor([0, 1]), torch.tensor([0, 1]))
    second = AttentionGroup(torch.tensor([[2], [0]]), tables, mask, torch.tensor([0]), torch.tensor([2]))
    together = cache.reader.attend(q, k, v, 0, [first, second], 0.25)
    alone = cache.reader.attend(q[[2, 0]], k[[2, 0]], v[[2, 0]], 0,
                                [AttentionGroup(torch.tensor([[0], [1]]), tables, mask, None, None)], 0.25)
    assert torch.equal(together[2], alone[0])
    assert torch.equal(together[:2], cache.reader.attend(q[:2], k[:2], v[:2], 0, [decode_group()], 0.25))


def test_a_single_streams_decode_in_a_compiled_graph_reads_by_sums_and_equals_the_kernels_read(monkeypatch):
    """Inside a graph torch.compile traces (the whole graph), one request's decode attends by products and sums
    (readers.decode_sums) over the keys where they lie; its result equals scaled_dot_product_attention's eager one."""
    cache = filled("float32")
    group = AttentionGroup(torch.tensor([[0]]), torch.tensor([[3, 1]]), torch.arange(2 * BS).view(1, 1, 1, -1) < 7,
                           None, None)
    q, k, v = new_tokens(1)
    traced, decode_sums = [], readers.decode_sums

    def counted(*args):
        traced.append(True)
        return decode_sums(*args)

    monkeypatch.setattr(readers, "decode_sums", counted)
    compiled = torch.compile(lambda q, k, v: cache.reader.attend(q, k, v, 0, [group], 0.25), fullgraph=True)
    out = compiled(q, k, v)
    assert traced  # the sums, not the kernel, inside the graph
    eager = cache.reader.attend(q, k, v, 0, [group], 0.25)
    assert torch.allclose(out, eager, atol=1e-5)  # sums in another order: float32 ulps on any CPU's vector width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sums_equal_scaled_dot_product_attention_for_grouped_heads(dtype):
    g = torch.Generator().manual_seed(2)
    queries = torch.randn(1, 1, HEADS * PER_HEAD, DIM, generator=g).to(dtype)
    keys, values = (torch.randn(1, 24, HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    mask = torch.arange(24).view(1, 1, 1, -1) < 21
    expected = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, scale=0.25, enable_gqa=True).transpose(1, 2)
    out = readers.decode_sums(queries, keys, values, mask, 0.25)
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.allclose(out.float(), expected.float(), atol=1e-6 if dtype == torch.float32 else 2e-2)
