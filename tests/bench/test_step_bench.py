"""`kvserve bench step` end to end on a tiny model: every batch it is asked for gets its line, with each runner that
can take the step (the whole graph only where attention is one call per layer group), and the engine is left with
no request and every block back in the pool."""
import re

import pytest

from kvserve.cli import main
from kvserve.model import linear
from kvserve.model.float_kernels import BLAS
from tests.conftest import make_tiny_model

MS = r"[\d.]+"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_bench_step_times_each_batch_eagerly_and_in_each_graph_that_takes_it(tmp_path, capsys, monkeypatch,
                                                                             kv_cache_dtype):
    """float32 blocks are read in place (kv/formats/flex_decode.py): spread contexts too are one attention call per
    layer group, which the whole graph takes; bfloat16 ones are gathered, spread contexts in several calls. Serving
    gives several sequences the whole graph where it takes them (a tiny model's padded K/V is small)."""
    engines = []
    from kvserve.engine import llm_engine
    init = llm_engine.LLMEngine.__init__
    monkeypatch.setattr(llm_engine.LLMEngine, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), engines.append(self))[0])
    status = main(["bench", "step", "--model", str(make_tiny_model(tmp_path)), "--sequences", "1", "3",
                   "--repeat", "2", "--kv-cache-memory", "4MiB", "--kv-cache-dtype", kv_cache_dtype])
    out = capsys.readouterr().out
    assert status == 0
    assert re.search(rf"^1 sequence, alike contexts \(1 attention call per layer group\): eager {MS}, whole graph "
                     rf"{MS} \({MS}x\); serving runs: whole graph$", out, re.MULTILINE)
    assert re.search(rf"^3 sequences, alike contexts \(1 attention call per layer group\): eager {MS}, whole graph "
                     rf"{MS} \({MS}x\), attention outside {MS} \({MS}x\); serving runs: whole graph$", out,
                     re.MULTILINE)
    if kv_cache_dtype == "auto":
        assert re.search(rf"^3 sequences, spread contexts \(1 attention call per layer group\): eager {MS}, whole "
                         rf"graph {MS} \({MS}x\), attention outside {MS} \({MS}x\); serving runs: whole graph$",
                         out, re.MULTILINE)
    else:
        spread = re.search(rf"^3 sequences, spread contexts \((\d) attention calls per layer group\): eager {MS}, "
                           rf"attention outside {MS} \({MS}x\); serving runs: attention outside$", out, re.MULTILINE)
        assert spread and int(spread.group(1)) > 1
    # under each batch of several: its attention's time and K/V read rate beside the CPU's
    attention = re.findall(rf"^  its attention, outside the graph: (-?{MS}) ms \(the graph with attention returning "
                           rf"zeros {MS}\), ({MS}) MB of K/V read once: (?:{MS} GB/s|no time measured); this CPU "
                           rf"reads {MS} GB/s$", out, re.MULTILINE)
    assert len(attention) == 2 and all(float(mb) > 0 for _, mb in attention)
    (engine,) = engines
    assert not engine.requests and engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_bench_step_times_a_format_with_its_own_decode_kernel_with_attention_outside(tmp_path, capsys,
                                                                                    kv_cache_dtype):
    """int8 and int4 K/V attend with their own compiled kernels, so the engine compiles no whole graph: every batch,
    a single stream's too, is timed eagerly and with attention outside, and gets its attention's line."""
    status = main(["bench", "step", "--model", str(make_tiny_model(tmp_path)), "--sequences", "1", "2", "--contexts",
                   "alike", "--repeat", "2", "--kv-cache-memory", "4MiB", "--kv-cache-dtype", kv_cache_dtype])
    out = capsys.readouterr().out
    assert status == 0
    assert "compiles no whole decode graph" in out
    for batch in ("1 sequence", "2 sequences"):
        assert re.search(rf"^{batch}, alike contexts \(1 attention call per layer group\): eager {MS}, attention "
                         rf"outside {MS} \({MS}x\); serving runs: attention outside$", out, re.MULTILINE), batch
    assert len(re.findall(r"^  its attention, outside the graph: ", out, re.MULTILINE)) == 2


def test_bench_step_replays_a_step_that_fills_a_block_of_a_staged_format(tmp_path, capsys, monkeypatch):
    """int4 quantizes a block when a step fills it, from staged tokens that the next step gives back: each replay of
    a captured step that fills one keeps them (rewind_step) and fills it again (it raised "a block is completed
    without the staged tokens before it" at the second replay)."""
    from kvserve.bench import step

    # a prompt of 302 tokens: the first decode step writes position 302, the captured second one 303, a block's last
    monkeypatch.setattr(step, "ALIKE_LENGTH", 302)
    decode_step, fills = step._decode_step, []

    def checked(engine, num_seqs, kind):
        input_ids, meta = decode_step(engine, num_seqs, kind)
        fills.append(bool(((meta.slot_mappings[0] + 1) % engine.cache.block_size == 0).all()))
        return input_ids, meta

    monkeypatch.setattr(step, "_decode_step", checked)
    status = main(["bench", "step", "--model", str(make_tiny_model(tmp_path)), "--sequences", "1", "--repeat", "3",
                   "--kv-cache-memory", "4MiB", "--kv-cache-dtype", "int4"])
    assert status == 0 and fills == [True]
    assert re.search(rf"^1 sequence, alike contexts .*: eager {MS}, attention outside {MS}", capsys.readouterr().out,
                     re.MULTILINE)


def test_bench_step_needs_the_compiled_graphs(tmp_path):
    with pytest.raises(ValueError, match="compile_decode=True contradicts enforce_eager=True"):
        main(["bench", "step", "--model", str(make_tiny_model(tmp_path)), "--enforce-eager"])


@pytest.mark.slow
def test_bench_step_with_compile_gemms_times_one_sequence(tmp_path, capsys, monkeypatch):
    """--compile-gemms runs one sequence's whole graph as two rows, which writes two rows' slots: each replay begins
    the step's own slots again, so the eager replay after it writes one row (it failed with index_copy_'s size
    error). Serving runs its frozen whole graph for alike batches too, and the line says so."""
    monkeypatch.setattr(linear, "choose_matmul", lambda dtype, shapes=None: BLAS)  # weights --compile-gemms freezes
    status = main(["bench", "step", "--model", str(make_tiny_model(tmp_path)), "--sequences", "1", "2", "--contexts",
                   "alike", "--repeat", "2", "--kv-cache-memory", "4MiB", "--compile-gemms"])
    assert status == 0
    out = capsys.readouterr().out
    assert re.search(rf"^1 sequence, alike contexts \(1 attention call per layer group\): eager {MS}, whole graph "
                     rf"{MS} \({MS}x\); serving runs: whole graph$", out, re.MULTILINE)
    assert re.search(rf"^2 sequences, alike contexts \(1 attention call per layer group\): eager {MS}, whole graph "
                     rf"{MS} \({MS}x\), attention outside {MS} \({MS}x\); serving runs: whole graph$", out,
                     re.MULTILINE)
