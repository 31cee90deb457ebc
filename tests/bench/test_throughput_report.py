"""What `kvserve bench throughput` prints under its tables, over made-up runs: the decode split (which rows' time is
split into matmuls and the rest) and the roofline's two ceilings."""
import io
import re
from collections import Counter
from types import SimpleNamespace

from rich.console import Console

from kvserve.bench.throughput import report
from kvserve.bench.throughput.results import Routes, RunResult
from kvserve.model import float_kernels, int8_kernels


def test_a_compiled_single_stream_is_not_split_by_blas_matmuls(monkeypatch):
    """A compiled graph multiplies one row by float weights in Inductor's own loops (model/linear.py, one_row_in_graph),
    not the BLAS calls the split replays: its single stream's time is not split (its rest would come out below zero); an
    eager single stream's is, and so are compiled batched steps and int8 weights' rows (their own kernel's, said as
    such, or at one row the graph's loops over their codes). Each row's routes are its engine's (Routes), whatever its
    name says."""
    cfg = SimpleNamespace(num_heads=2, head_dim=8, num_kv_heads=1, hidden_size=16, intermediate_size=32, num_layers=2,
                          vocab_size=64)
    blas, int8 = float_kernels.BLAS, int8_kernels.IntMMKernel()
    monkeypatch.setattr(float_kernels, "choose_matmul", lambda dtype, shapes=None: blas)  # what the split replays

    def printed(rows: int, float_matmul=blas, extra: tuple = ()) -> str:
        rows_routes = [("row a", Routes(float_matmul, None, False, False)),
                       ("row b", Routes(float_matmul, None, True, False, one_row_loops=True)),
                       ("row c", Routes(blas, int8, True, False)),
                       ("row d", Routes(blas, int8_kernels.FloatKernel(), True, False)),
                       ("row h", Routes(blas, int8_kernels.OneDNNKernel(), True, False, one_row_loops=True)), *extra]
        runs = [RunResult(name, 8, 1.0, decode_tokens=8, decode_seconds=0.5,
                                     steps=Counter({(rows, rows): 8 // rows}), routes=routes)
                for name, routes in rows_routes]
        console = Console(file=io.StringIO(), width=400)
        report.print_decode_split(console, runs, cfg)
        return console.file.getvalue()

    single = printed(1)
    assert "row a: 62.5 ms = matmuls" in single
    assert "row b: 62.5 ms, " in single and "(no split: its matmuls are Inductor's matrix-vector loops" in single
    assert "row c: 62.5 ms, " in single and "(no split: its matmuls are torch._int_mm's int8 ones)" in single
    assert "row d: 62.5 ms = matmuls" in single  # int8 codes multiplied as float32 by F.linear, as replayed
    assert "row h: 62.5 ms, " in single and ("(no split: its matmuls are Inductor's loops over the int8 codes on every "
                                             "core, not onednn.qlinear's calls)") in single
    batched = printed(4)
    assert "(no split: its matmuls are onednn.qlinear's int8 ones)" in batched  # several rows: the kernel's calls
    assert "row b: 62.5 ms = matmuls" in batched and "Inductor's matrix-vector loops" not in batched
    # oneDNN's float linear: the replay multiplies as the engine did, so those rows are split; a row that kept
    # F.linear (--batch-invariant) is not
    route = float_kernels.OneDNNMatmul()
    monkeypatch.setattr(float_kernels, "choose_matmul", lambda dtype, shapes=None: route)
    onednn = printed(1, route, extra=[("row e", Routes(blas, None, False, False)),
                                      ("row f", Routes(route, None, True, True)),
                                      ("row g", Routes(route, None, True, False))])
    assert "row b: 62.5 ms, " in onednn  # --compile-decode's dense weights: the graph's loops at one row
    assert "row g: 62.5 ms = matmuls" in onednn and onednn.count("matrix-vector loops") == 1
    assert "row e: 62.5 ms, " in onednn and "(no split: its matmuls are F.linear's, not the replayed oneDNN" in onednn
    assert "row f: 62.5 ms, " in onednn and "(no split: its matmuls are Inductor's GEMM template" in onednn
    # a row without routes (not kvserve's) is not split at all
    assert "transformers" not in printed(1, extra=[("transformers", None)])


def test_the_second_ceiling_takes_prompt_steps_as_they_ran_and_is_left_out_where_drafts_were_verified(monkeypatch):
    """The roofline's ceilings: decode-only steps at their replayed matmuls plus one K/V read, and the steps with
    prompt tokens at their matmuls too or as long as they took (the run's time less its decode steps'). A row that
    verified drafts gets the first only: its verification steps are timed with its decode steps but are none."""
    cfg = SimpleNamespace(num_heads=2, head_dim=8, num_kv_heads=1, hidden_size=16, intermediate_size=32, num_layers=2,
                          vocab_size=64)
    monkeypatch.setattr(float_kernels, "choose_matmul", lambda dtype, shapes=None: float_kernels.BLAS)
    monkeypatch.setattr("kvserve.bench.roofline.read_bandwidth", lambda: 1e9)
    monkeypatch.setattr("kvserve.bench.roofline.step_seconds",  # a prompt step's matmuls 1 s, a decode step's 0.25 s
                        lambda shapes, steps, reps=2, matmul=None: {shape: 1.0 if shape[0] > shape[1] else 0.25
                                                                    for shape in steps})
    steps = Counter({(64, 4): 2, (4, 4): 8})  # 2 s of the prompt steps' matmuls, 2 s of the decode steps'
    runs = [RunResult(name, 40, 10.0, decode_tokens=32, decode_seconds=5.0, steps=steps,
                                 decode_kv_bytes=10**9, drafts=drafts)  # a K/V read of 1 s at 1 GB/s
            for name, drafts in (("plain", 0), ("drafted", 3))]
    console = Console(file=io.StringIO(), width=400)
    report.print_roofline(console, runs, cfg)
    out = console.file.getvalue()
    # 4 s of matmuls in a 10 s run: 40%; ceilings 4 / (2 + 2 + 1) and, the prompt steps as they ran, 4 / (5 + 2 + 1)
    assert re.search(r"plain: [\d.]+ GFLOP/s = 40% of that \(ceiling 80%: 1\.0 GB of K/V; 50% with its steps with "
                     r"prompt tokens as they ran, 5\.0 s\)", out)
    assert re.search(r"drafted: [\d.]+ GFLOP/s = 40% of that \(ceiling 80%: 1\.0 GB of K/V\)\n", out)
