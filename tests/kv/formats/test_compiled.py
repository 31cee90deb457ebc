"""Decode attention compiled over a quantized format's stored form equals attention over its eager read, for any
batch shape after one warm-up (no graph compiled after it), and falls back to the eager path when it cannot
compile."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kvserve import saved_graphs
from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats import int4, int8, nonuniform
from kvserve.kv.formats.codebook import codebook
from kvserve.kv.formats.compiled import KERNEL_DIRECTORY, CompiledFunction
from kvserve.planner.layout import KVLayout

BS = 8
FORMATS = ["int8", "int4", "nuq4", "nuq3"]  # fp8 attends eagerly: compiled, its float8 widening is not vectorised (formats.fp8)


def filled_cache(fmt: str, blocks: int, heads: int, dim: int, dtype=torch.float32, compile: bool = True,
                 spare_blocks: int = 8):
    """One layer with `blocks` full blocks, then a block holding 2 tokens (int4: staged in full precision)."""
    spec = KVCacheSpec(fmt, KVLayout.uniform(1), blocks + spare_blocks, BS, heads, dim, dtype, max_num_seqs=8,
                       compile=compile)
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


def assert_attends_as_eager(cache, dtype=torch.float32, seed: int = 1) -> None:
    """The compiled decode attention over batches of several shapes equals attention over the eager read."""
    g = torch.Generator().manual_seed(seed)
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_attention_equals_attention_over_the_eager_read(fmt, dtype):
    cache = filled_cache(fmt, blocks=12, heads=2, dim=16, dtype=dtype)
    cache.warm_up(num_query_heads=6)
    assert_attends_as_eager(cache, dtype)


def kernel_files() -> list:
    return sorted((saved_graphs.graph_directory() / KERNEL_DIRECTORY).glob("*.bin"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_later_cache_loads_the_saved_kernel_and_runs_every_batch_shape_without_tracing(fmt, monkeypatch):
    """The warm-up saves its graphs whole (kvserve/saved_graphs.py); a cache of another pool size, with this
    process's kernels forgotten as in a new process, loads them, runs no Dynamo, and its every batch shape attends
    as the eager read."""
    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})
    first = filled_cache(fmt, blocks=12, heads=2, dim=16)
    first.warm_up(num_query_heads=6)
    assert (first.fused_decode.graphs_loaded, first.fused_decode.graphs_compiled) == (0, 2)  # 8 requests, and 1
    store = getattr(first, "compiled_store", None)  # nuq's block store: one graph for any number of blocks
    assert store is None or (store.graphs_loaded, store.graphs_compiled) == (0, 1)
    assert [f.stat().st_mode & 0o777 for f in kernel_files()] == [0o600] * (2 if store is None else 3)
    saved_graphs.PROCESS_GRAPHS.clear()
    counters.clear()
    cache = filled_cache(fmt, blocks=12, heads=2, dim=16, spare_blocks=30)  # another pool size
    cache.warm_up(num_query_heads=6)
    assert (cache.fused_decode.graphs_loaded, cache.fused_decode.graphs_compiled) == (2, 0)
    assert store is None or (cache.compiled_store.graphs_loaded, cache.compiled_store.graphs_compiled) == (1, 0)
    assert_attends_as_eager(cache, seed=4)
    assert counters["stats"]["unique_graphs"] == 0 and cache.fused_decode.failed is None


NEW_PROCESS = """
import json, sys
from torch._dynamo.utils import compilation_time_metrics
from tests.kv.formats.test_compiled import assert_attends_as_eager, filled_cache
cache = filled_cache(sys.argv[1], blocks=12, heads=2, dim=16)
cache.warm_up(num_query_heads=6)
assert_attends_as_eager(cache)
traced = sum(compilation_time_metrics.get("bytecode_tracing", ()))
print(json.dumps([cache.fused_decode.graphs_loaded, cache.fused_decode.graphs_compiled, traced]))
"""


def test_a_new_process_loads_the_kernel_and_traces_nothing(tmp_path):
    """Two processes on one empty cache directory: the first compiles and saves the int8 kernel's two graphs, the
    second loads them, traces nothing (Dynamo's own timer) and attends as the eager read."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def start() -> list:
        done = subprocess.run([sys.executable, "-c", NEW_PROCESS, "int8"], env=env, capture_output=True, text=True,
                              cwd=Path(__file__).parents[3], timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    loaded, compiled, traced = start()
    assert (loaded, compiled) == (0, 2) and traced > 0
    assert start() == [2, 0, 0]


def test_a_saved_kernel_that_cannot_be_read_or_others_may_write_is_compiled_again(monkeypatch, caplog):
    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})
    filled_cache("int8", blocks=3, heads=2, dim=16).warm_up(num_query_heads=6)
    truncated, foreign = kernel_files()
    truncated.write_bytes(truncated.read_bytes()[:100])
    foreign.chmod(0o620)
    saved_graphs.PROCESS_GRAPHS.clear()
    cache = filled_cache("int8", blocks=12, heads=2, dim=16)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        cache.warm_up(num_query_heads=6)
    assert (cache.fused_decode.graphs_loaded, cache.fused_decode.graphs_compiled) == (0, 2)
    assert caplog.text.count("could not be loaded") == 1
    assert caplog.text.count("may be written by other users; compiling it again") == 1
    assert truncated.stat().st_size > 100 and foreign.stat().st_mode & 0o777 == 0o600  # written over
    assert_attends_as_eager(cache)


def test_a_kernels_name_holds_its_block_size_and_bits():
    """A saved kernel keeps the values its closure held when it compiled: they name its file (the nonuniform
    kernel's codebook polynomial too: its coefficients are constants of the generated loops)."""
    def name(kernel):
        return saved_graphs.GraphKey.of(kernel.fn).digest

    def nonuniform_kernel(block_size, key_bits, value_bits, coefficients=None):
        coefficients = coefficients or codebook(64, value_bits)[2]
        return nonuniform.fused_decode_attention(block_size, key_bits, value_bits, coefficients)

    assert name(int8.fused_decode_attention(16)) == name(int8.fused_decode_attention(16))
    assert name(int8.fused_decode_attention(16)) != name(int8.fused_decode_attention(32))
    assert name(nonuniform_kernel(16, 4, 4)) != name(nonuniform_kernel(16, 3, 3))
    assert name(nonuniform_kernel(16, 4, 4)) != name(nonuniform_kernel(16, 4, 4, codebook(128, 4)[2]))
    assert name(nonuniform_kernel(16, 4, 4)) == name(nonuniform_kernel(16, 4, 4))
    assert name(int4.fused_decode_attention(16)) != name(int8.fused_decode_attention(16))


def test_a_call_no_warmed_graph_takes_is_attended_eagerly_without_compiling(caplog):
    """Nothing compiles after the warm-up: a call made unlike the warm-up's (outside inference mode) is declined,
    once said, and the reader gathers."""
    cache = filled_cache("int8", blocks=3, heads=2, dim=16)
    cache.warm_up(num_query_heads=2)
    graphs = counters["stats"]["unique_graphs"]
    new = torch.zeros(2, 1, 2, 16)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        for _ in range(2):
            assert cache.decode_attention(0, torch.randn(2, 2, 1, 16), torch.tensor([[0, 1], [1, 2]]),
                                          torch.tensor([-1, -1]), new, new,
                                          torch.ones(2, 1, 1, 2 * BS, dtype=torch.bool), 0.25) is None
    assert counters["stats"]["unique_graphs"] == graphs and cache.fused_decode.failed is None
    assert caplog.text.count("fits no compiled int8_decode_attention") == 1


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
    def no_compiler(fn, **kwargs):
        raise RuntimeError("no working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", no_compiler)
    compiled = CompiledFunction(lambda x: x + 1)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        with compiled.warming_up():
            assert compiled((torch.zeros(2),)) is None
        assert compiled((torch.zeros(2),)) is None
    assert compiled.failed == "RuntimeError: no working C++ compiler found"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "running it eagerly" in warnings[0] and "no working C++ compiler" in warnings[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_compile_is_that_caches_own_and_a_second_cache_compiles_nothing(fmt, monkeypatch):
    first, second = filled_cache(fmt, blocks=3, heads=2, dim=16), filled_cache(fmt, blocks=3, heads=2, dim=16)
    assert first.fused_decode is not second.fused_decode

    def fails(*args, **kwargs):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(saved_graphs, "PROCESS_GRAPHS", {})  # compiled here, not an earlier test's kernel
    with monkeypatch.context() as patch:
        patch.setattr(torch, "compile", fails)
        first.warm_up(num_query_heads=2)
    assert first.fused_decode.failed == "RuntimeError: no working C++ compiler found"
    second.warm_up(num_query_heads=2)  # compiles: the other engine's failure is not this one's
    assert second.fused_decode.failed is None
    third = filled_cache(fmt, blocks=3, heads=2, dim=16)
    counters.clear()
    third.warm_up(num_query_heads=2)  # the same shapes as `second`'s: its graphs, nothing compiled
    assert third.fused_decode.failed is None and counters["stats"]["unique_graphs"] == 0
    extra = BS + 1 if third.exact_own_block else 0
    # as the engine makes them: the batch's tensors outside inference mode, the model's inside
    tables, own, mask = torch.tensor([[0, 1]]), torch.tensor([-1]), torch.ones(1, 1, 1, 2 * BS + extra, dtype=torch.bool)
    with torch.inference_mode():
        new_k, new_v = torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2, 16)
        out = third.decode_attention(0, torch.randn(1, 2, 1, 16), tables, own, new_k, new_v, mask, 0.25)
    assert out is not None
