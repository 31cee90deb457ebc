"""Decode attention compiled over a quantized format's stored form equals attention over its eager read, for any
batch shape after one warm-up (no graph compiled after it), and falls back to the eager path when it cannot
compile."""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats.compiled import CompiledFunction
from kvserve.planner.layout import KVLayout

BS = 8
FORMATS = ["int8", "int4", "nuq4", "nuq3"]  # fp8 attends eagerly: compiled, its float8 widening is not vectorised (formats.fp8)


def filled_cache(fmt: str, blocks: int, heads: int, dim: int, dtype=torch.float32, compile: bool = True):
    """One layer with `blocks` full blocks, then a block holding 2 tokens (int4: staged in full precision)."""
    spec = KVCacheSpec(fmt, KVLayout.uniform(1), blocks + 8, BS, heads, dim, dtype, max_num_seqs=8, compile=compile)
    cache = make_kv_cache(spec)
    g = torch.Generator().manual_seed(0)
    n = blocks * BS + 2
    cache.begin_step([], [], [torch.arange(n)])
    k = torch.randn(n, heads, dim, generator=g) * 3 + 1
    cache.write(0, k.to(dtype), torch.randn(n, heads, dim, generator=g).to(dtype))
    cache.begin_step([], [], [torch.tensor([n])])
    return cache


def eager(cache, queries, tables, own, new_k, new_v, mask, scale):
    """What attention does without the compiled path: the eager read, then scaled_dot_product_attention."""
    if cache.exact_own_block:
        keys, values = cache.gather_with_own_block(0, tables, own, new_k, new_v)
    else:
        keys, values = cache.gather(0, tables)
    rotation = cache.rotation if cache.rotation is not None else torch.eye(queries.shape[-1], dtype=queries.dtype)
    out = F.scaled_dot_product_attention((queries @ rotation).float(), keys.transpose(1, 2).float(),
                                         values.transpose(1, 2).float(), attn_mask=mask, scale=scale)
    return out @ rotation.T.float()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_attention_equals_attention_over_the_eager_read(fmt, dtype):
    cache = filled_cache(fmt, blocks=12, heads=2, dim=16, dtype=dtype)
    cache.warm_up(num_query_heads=6)
    g = torch.Generator().manual_seed(1)
    extra = BS + 1 if cache.exact_own_block else 0  # int4: the own block's staged tokens, then the new one
    for S, B in [(1, 1), (3, 5), (1, 12), (4, 2)]:
        tables = torch.randint(0, 13, (S, B), generator=g)  # block 12 is the partly filled one
        own = torch.where(torch.arange(S) % 2 == 0, 12, -1)
        mask = torch.rand(S, 1, 1, B * BS + extra, generator=g) > 0.3
        mask[..., -1] = True
        with torch.inference_mode():
            queries = torch.randn(S, 2, 3, 16, generator=g).to(dtype)
            new_k, new_v = (torch.randn(S, 1, 2, 16, generator=g).to(dtype) for _ in range(2))
            fused = cache.decode_attention(0, queries, tables, own, new_k, new_v, mask, 0.25)
            reference = eager(cache, queries, tables, own, new_k, new_v, mask, 0.25)
        assert fused is not None and fused.dtype == dtype and fused.shape == (S, 2, 3, 16)
        tolerance = 2e-5 if dtype == torch.float32 else 3e-2  # bfloat16: the eager read rounds K/V to bfloat16
        torch.testing.assert_close(fused.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("fmt", FORMATS)
def test_after_warm_up_no_batch_shape_compiles_again(fmt):
    cache = filled_cache(fmt, blocks=40, heads=3, dim=32)
    cache.warm_up(num_query_heads=6)
    compiled = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(2)
    extra = BS + 1 if cache.exact_own_block else 0
    for S, B in [(1, 1), (2, 1), (1, 7), (9, 4), (5, 40)]:
        # as the engine makes them: the batch's tensors outside inference mode, the model's inside
        mask = torch.ones(S, 1, 1, B * BS + extra, dtype=torch.bool)
        tables = torch.randint(0, 40, (S, B), generator=g)
        with torch.inference_mode():
            new_k, new_v = (torch.randn(S, 1, 3, 32, generator=g) for _ in range(2))
            out = cache.decode_attention(0, torch.randn(S, 3, 2, 32, generator=g), tables, torch.full((S,), -1), new_k,
                                         new_v, mask, 0.2)
        assert out is not None and out.shape == (S, 3, 2, 32)
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_compiling_decode_attention_is_left_to_the_eager_path(fmt):
    cache = filled_cache(fmt, blocks=2, heads=2, dim=16, compile=False)
    cache.warm_up(num_query_heads=2)  # nothing to compile
    assert cache.fused_decode is None and "eager decode attention" in cache.describe()
    new = torch.zeros(1, 1, 2, 16)
    assert cache.decode_attention(0, torch.zeros(1, 2, 1, 16), torch.tensor([[0]]), torch.tensor([-1]), new, new,
                                  torch.ones(1, 1, 1, 2 * BS + 1, dtype=torch.bool), 1.0) is None


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_narrower_floats_and_fp8_have_no_decode_attention_of_their_own(fmt):  # float32: formats.flex_decode
    cache = filled_cache(fmt, blocks=2, heads=2, dim=16)
    cache.warm_up(num_query_heads=2)
    new = torch.zeros(1, 1, 2, 16)
    assert cache.decode_attention(0, torch.zeros(1, 2, 1, 16), torch.tensor([[0]]), torch.tensor([-1]), new, new,
                                  torch.ones(1, 1, 1, BS, dtype=torch.bool), 1.0) is None


def test_a_failed_compile_is_logged_once_and_falls_back(monkeypatch, caplog):
    def no_compiler(fn):
        def fails(*args):
            raise RuntimeError("no working C++ compiler found\nmore detail")
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    compiled = CompiledFunction(lambda x: x + 1)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert compiled((torch.zeros(2),)) is None
        assert compiled((torch.zeros(2),)) is None
    assert compiled.failed == "RuntimeError: no working C++ compiler found"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "attending eagerly" in warnings[0] and "no working C++ compiler" in warnings[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_compile_is_that_caches_own_and_a_second_cache_compiles_nothing(fmt, monkeypatch):
    first, second = filled_cache(fmt, blocks=3, heads=2, dim=16), filled_cache(fmt, blocks=3, heads=2, dim=16)
    assert first.fused_decode is not second.fused_decode

    def fails(*args):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(first.fused_decode, "compiled", fails)
    first.warm_up(num_query_heads=2)
    assert first.fused_decode.failed == "RuntimeError: no working C++ compiler found"
    second.warm_up(num_query_heads=2)  # compiles: the other engine's failure is not this one's
    assert second.fused_decode.failed is None
    third = filled_cache(fmt, blocks=3, heads=2, dim=16)
    counters.clear()
    third.warm_up(num_query_heads=2)  # the same shapes as `second`'s: its graphs, nothing compiled
    assert third.fused_decode.failed is None and counters["stats"]["unique_graphs"] == 0
    extra = BS + 1 if third.exact_own_block else 0
    new = torch.zeros(1, 1, 2, 16)
    with torch.inference_mode():
        out = third.decode_attention(0, torch.randn(1, 2, 1, 16), torch.tensor([[0, 1]]), torch.tensor([-1]), new,
                                     new, torch.ones(1, 1, 1, 2 * BS + extra, dtype=torch.bool), 0.25)
    assert out is not None
