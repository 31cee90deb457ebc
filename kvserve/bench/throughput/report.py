"""What `kvserve bench throughput` prints: a table per workload and for the single stream (each engine's tokens/s and
its ratios to the baselines), the rounds' ratios with --repeat, speculation and compiled-step counts, and the
roofline lines that compare each kvserve run's matmul FLOP/s with float32 matmuls of the same shapes replayed in the
same run (kvserve/bench/roofline.py)."""
from __future__ import annotations

import statistics

from kvserve.bench.throughput.results import RunResult, agreement
from kvserve.bench.throughput.workloads import Workload


def cpu_name() -> str:
    """The CPU model and the vector/matrix extensions that decide which kernels are fast."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    kinds = [k for k in ("amx_int8", "amx_bf16", "avx512_vnni", "avx512f", "avx2") if k in flags]
    return f"{model} ({', '.join(kinds) or 'no AVX2'})"


def speeds(results: list[RunResult | str]) -> dict[str, float]:
    """Tokens/s of the engines that ran (a str is one that could not)."""
    return {r.name: r.tokens_per_s for r in results if isinstance(r, RunResult)}


def print_workload(console, workload: Workload, rows: list[RunResult | str], num_kvserve: int, model_config,
                   hf_batch_size: int | None, roofline: bool, hf_dtype: str = "float32") -> None:
    """A workload's table and the lines under it; `hf_batch_size` None: transformers did not run."""
    print_table(console, f"Batched throughput, {workload.name} (output tokens/s)", rows)
    print_phases(console, rows, num_kvserve)
    if hf_batch_size is not None and workload.name != "long-context":
        console.print(f"transformers: {hf_dtype}, generate() on left-padded static batches of {hf_batch_size}")
        reference = next(r for r in rows if isinstance(r, RunResult) and r.name == "transformers")
        for r in rows[:num_kvserve]:
            console.print(f"{r.name}: greedy output identical to transformers for {agreement(r, reference):.0%} "
                          "of requests")
    print_compiled_steps(console, rows[:num_kvserve])
    if any(isinstance(r, RunResult) and r.name.startswith("llama.cpp") for r in rows):
        console.print("llama.cpp: llama-cpp-python on the Q4_1 GGUF; serial: one request after another; "
                      "batched: all requests in one llama_decode per step (its batch API)")
    if roofline:
        print_roofline(console, rows[:num_kvserve], model_config)
        print_decode_split(console, rows[:num_kvserve], model_config)


def print_single_stream(console, prompts: list[list[int]], output_len: int, rows: list[RunResult | str],
                        num_kvserve: int, rounds: list[list[RunResult]], paired: list[RunResult | str],
                        model_config, roofline: bool) -> None:
    """The single stream's table and the lines under it (`rounds`: each configuration's runs; `paired`: llama.cpp's
    run after each of them)."""
    shape = (f"{len(prompts[0])}-token prompt" if len(prompts) == 1 else
             f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens one after another")
    print_table(console, f"Single stream ({shape}, {output_len} new tokens each; tokens/s incl. prefill)", rows)
    print_phases(console, rows, num_kvserve)
    print_speculation(console, rows)
    print_compiled_steps(console, rows[:num_kvserve])
    print_rounds(console, rounds)
    print_llama_cpp_pairs(console, rounds, paired)
    if roofline:
        print_decode_split(console, rows[:num_kvserve], model_config)


def print_table(console, title: str, results: list[RunResult | str]) -> None:
    """One row per engine: its speed against each baseline that ran and against the first kvserve row (a str is
    one that could not run); kvserve rows also show decode-only tokens/s (steps that prefilled nothing)."""
    from rich.table import Table

    ran = [r for r in results if isinstance(r, RunResult)]
    baselines = [r for r in ran if not r.name.startswith("kvserve")]
    first = next((r for r in ran if r.name.startswith("kvserve")), None)
    compared = ([first] if first is not None else []) + baselines
    table = Table(title=title)
    columns = ["engine", "output tokens", "seconds", "tokens/s"] + [f"÷ {b.name}" for b in compared] + \
        ["decode tokens/s", f"decode ÷ {first.name}" if first else "decode"]
    phases = any(b.prefill_seconds for b in baselines)  # --phases timed a baseline's prefill: show every row's
    columns += ["prefill tokens/s"] if phases else []
    for column in columns:
        table.add_column(column, justify="left" if column == "engine" else "right")
    for r in results:
        if isinstance(r, str):
            table.add_row(f"did not run: {r}", *["-"] * (len(columns) - 1))
            continue
        ratios = [f"{r.tokens_per_s / b.tokens_per_s:.2f}x" for b in compared]
        decode = r.decode_tokens_per_s
        decode_ratio = (f"{decode / first.decode_tokens_per_s:.2f}x"
                        if decode and first is not None and first.decode_tokens_per_s else "-")
        prefill = [f"{r.prefill_tokens_per_s:,.0f}" if r.prefill_tokens_per_s else "-"] if phases else []
        table.add_row(r.name, f"{r.output_tokens:,}", f"{r.seconds:.1f}", f"{r.tokens_per_s:.1f}", *ratios,
                      f"{decode:.1f}" if decode else "-", decode_ratio, *prefill)
    console.print(table)


def print_phases(console, rows: list[RunResult | str], num_kvserve: int) -> None:
    """With --phases: each kvserve row's decode and prefill tokens/s over transformers' (kvserve's prefill: the steps
    with prompt tokens, decodes beside them included; transformers': each batch's time to its first logits)."""
    hf = next((r for r in rows if isinstance(r, RunResult) and r.name == "transformers" and r.prefill_seconds), None)
    if hf is None:
        return
    console.print(f"transformers phases: prefill = each batch's time to its first logits, {hf.prefill_seconds:.1f} s; "
                  f"decode = the other {hf.decode_tokens:,} tokens in the remaining {hf.decode_seconds:.1f} s",
                  soft_wrap=True)
    for r in rows[:num_kvserve]:
        if isinstance(r, RunResult) and r.decode_tokens_per_s and r.prefill_tokens_per_s:
            console.print(f"{r.name} ÷ transformers: decode {r.decode_tokens_per_s / hf.decode_tokens_per_s:.2f}x, "
                          f"prefill {r.prefill_tokens_per_s / hf.prefill_tokens_per_s:.2f}x", highlight=False,
                          soft_wrap=True)


def print_rounds(console, per_config: list[list[RunResult]]) -> None:
    """With --repeat: each configuration's tokens/s over the first one's, round by round, and the median."""
    if not per_config or len(per_config[0]) < 2:
        return
    console.print(f"kvserve rows: median of {len(per_config[0])} interleaved runs; tokens/s ÷ {per_config[0][0].name} "
                  "in each round (median):")
    for runs in per_config[1:]:
        ratios = [r.tokens_per_s / first.tokens_per_s for r, first in zip(runs, per_config[0])]
        console.print(f"  {runs[0].name}: {', '.join(f'{x:.2f}x' for x in ratios)} "
                      f"({statistics.median(ratios):.2f}x)")


def print_transformers_rounds(console, per_config: list[list[RunResult]], hf_runs: list[RunResult]) -> None:
    """With --repeat: each kvserve row over the transformers run of its own round, round by round, and the median
    (transformers' row is the median of its rounds)."""
    if len(hf_runs) < 2:
        return
    _print_ratios(console, f"transformers: median of {len(hf_runs)} runs, one at the end of each round; kvserve "
                  "tokens/s ÷ transformers in the same round (median):", per_config, [hf_runs] * len(per_config))


def print_llama_cpp_pairs(console, per_config: list[list[RunResult]], paired: list[RunResult | str]) -> None:
    """Each kvserve single stream over the llama.cpp run right after it, run by run, and the median."""
    if not paired or not all(isinstance(r, RunResult) for r in paired):
        return
    _print_ratios(console, "single stream ÷ llama.cpp run right after it, each run (median):", per_config,
                  [paired[i :: len(per_config)] for i in range(len(per_config))])


def _print_ratios(console, header: str, per_config: list[list[RunResult]], baselines: list[list[RunResult]]) -> None:
    """Each configuration's runs over their baseline runs, one by one, and the median ratio."""
    console.print(header)
    for runs, against in zip(per_config, baselines):
        ratios = [r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, against)]
        console.print(f"  {runs[0].name}: {', '.join(f'{x:.2f}x' for x in ratios)} ({statistics.median(ratios):.2f}x)")


def print_compiled_steps(console, rows: list[RunResult | str]) -> None:
    """--compile-decode rows: how many of their decode-only steps, and of their steps with prompt tokens, ran a
    compiled graph; the others ran eagerly, as in the eager row (compile/steps.py says which steps the graphs
    cover)."""
    for r in rows:
        if isinstance(r, RunResult) and "compiled decode" in r.name:
            console.print(f"{r.name}: compiled graphs ran {r.compiled_steps:,} of its {r.decode_steps:,} decode-only "
                          f"steps and {r.compiled_prefill_steps:,} of its {r.prefill_steps:,} steps with prompt tokens")


def print_speculation(console, rows: list[RunResult | str]) -> None:
    """Speculative rows: acceptance, mean accepted length, and whether the tokens match the first kvserve row's."""
    ran = [r for r in rows if isinstance(r, RunResult) and r.name.startswith("kvserve")]
    for r in ran:
        if not r.drafts:
            continue
        same = agreement(r, ran[0]) if r is not ran[0] else 1.0
        console.print(f"{r.name}: {r.accepted_tokens:,} of {r.draft_tokens:,} draft tokens accepted "
                      f"({r.accepted_tokens / max(r.draft_tokens, 1):.0%}) in {r.drafts:,} verifications: "
                      f"{1 + r.accepted_tokens / r.drafts:.2f} tokens per drafted step; greedy output identical to "
                      f"{ran[0].name} for {same:.0%} of requests")


def print_roofline(console, runs: list[RunResult], model_config) -> None:
    """Each row's matmul FLOP/s over the replayed rate, and two ceilings on that share (roofline.share_ceiling): its
    decode-only steps at their replayed matmuls plus one read of their K/V at the CPU's read bandwidth, its steps
    with prompt tokens at their replayed matmuls too (prefill's attention left out), or as long as they took."""
    from kvserve.bench.roofline import (MatmulShapes, decode_steps, read_bandwidth, replay_matmul, replayed_seconds,
                                        share_ceiling, step_seconds, workload_flops)

    shapes = MatmulShapes.of(model_config)
    reference = runs[0]
    replayed = replay_matmul(next((r.routes.shapes for r in runs if r.routes is not None), None))
    per_step = step_seconds(shapes, reference.steps, matmul=replayed)
    flops = workload_flops(shapes, reference.steps)
    roof = flops / replayed_seconds(per_step, reference.steps)
    decodes = decode_steps(reference.steps)  # their own rate: fewer tokens a step than a prompt's
    decode_roof = workload_flops(shapes, decodes) / replayed_seconds(per_step, decodes) if decodes else roof
    bandwidth = read_bandwidth()
    console.print(f"roofline: this workload's matmuls (linears and output head; attention not counted) are "
                  f"{flops / 1e9:,.0f} GFLOP; float32 matmuls of the same shapes ({replayed.name}, as the "
                  f"engine multiplies float32 here), replayed step by step now, run at {roof / 1e9:,.1f} GFLOP/s. "
                  f"Ceiling: the share the matmuls can be of a run whose decode-only steps take their matmuls and "
                  f"read their K/V once (each sequence's context a step) at this CPU's read bandwidth, "
                  f"{bandwidth / 1e9:.1f} GB/s now, and nothing more; its steps with prompt tokens at their "
                  f"matmuls' rate too, or as long as they took in the run")
    for run in runs:
        run_flops = workload_flops(shapes, run.steps)
        achieved = run_flops / run.seconds
        line = f"  {run.name}: {achieved / 1e9:,.1f} GFLOP/s = {achieved / roof:.0%} of that"
        if run.decode_kv_bytes:
            matmul_seconds = run_flops / roof
            decode_matmul_seconds = workload_flops(shapes, decode_steps(run.steps)) / decode_roof
            kv_seconds = run.decode_kv_bytes / bandwidth
            prompt_seconds = run.seconds - run.decode_seconds
            ceiling = share_ceiling(matmul_seconds, decode_matmul_seconds, kv_seconds)
            line += f" (ceiling {ceiling:.0%}: {run.decode_kv_bytes / 1e9:,.1f} GB of K/V"
            if not run.drafts:  # a verification step is neither: its time is in decode_seconds, its shape not
                as_ran = share_ceiling(matmul_seconds, decode_matmul_seconds, kv_seconds, prompt_seconds)
                line += f"; {as_ran:.0%} with its steps with prompt tokens as they ran, {prompt_seconds:.1f} s"
            line += ")"
        console.print(line)


def print_decode_split(console, runs: list[RunResult | str], model_config) -> None:
    """Each kvserve row's decode-only time per token, split into what its matmuls alone take (replayed now: plain
    float32, every layer's own weights, the first row's decode steps) and the rest (attention, norms, RoPE, the
    step's Python). Two bounds beside it: those matmuls plus the row's K/V read once at the CPU's read bandwidth,
    the least a token takes with the engine's matmul route; and the float32 weights read once a step at that
    bandwidth, the least any matmul kernel needs."""
    from kvserve.bench.roofline import MatmulShapes, decode_steps, matmul_seconds, read_bandwidth, replay_matmul

    ran = [r for r in runs if isinstance(r, RunResult) and r.decode_tokens and r.routes is not None]
    if not ran:
        return
    steps = decode_steps(ran[0].steps)
    tokens = sum(rows * count for (_, rows), count in steps.items())
    if not tokens:
        return
    replayed = replay_matmul(ran[0].routes.shapes)
    matmul_ms = matmul_seconds(MatmulShapes.of(model_config), steps, matmul=replayed) / tokens * 1e3
    bandwidth = read_bandwidth()
    shapes = MatmulShapes.of(model_config)
    weights_ms = 4 * shapes.flops(1, 1) / 2 * sum(steps.values()) / tokens / bandwidth * 1e3  # float32, once a step
    console.print(f"decode steps, per token: their matmuls alone (float32, {replayed.name}, every layer's own "
                  f"weights, replayed now) take {matmul_ms:.1f} ms, at most {1e3 / matmul_ms:,.1f} tokens/s; with "
                  f"a row's K/V read once (its contexts, at {bandwidth / 1e9:.1f} GB/s, this CPU's read bandwidth "
                  f"now) the least a token can take with these matmuls. Reading the float32 weights once a step at "
                  f"that bandwidth takes {weights_ms:.1f} ms a token: the floor under any matmul kernel")
    single = all(rows == 1 for _, rows in steps)  # the single stream's steps: one row each
    for run in ran:
        total_ms = run.decode_seconds / run.decode_tokens * 1e3
        own = _other_matmuls(run.routes, replayed, single)
        if own is not None:  # no split
            console.print(f"  {run.name}: {total_ms:.1f} ms, {total_ms / matmul_ms:.2f}x the replayed matmuls alone "
                          f"(no split: its matmuls are {own})")
            continue
        kv_ms = run.decode_kv_bytes / run.decode_tokens / bandwidth * 1e3
        least = (f"; least {matmul_ms + kv_ms:.1f} ms with its K/V read once ({kv_ms:.1f} ms), "
                 f"{(matmul_ms + kv_ms) / total_ms:.0%} of its time") if run.decode_kv_bytes else ""
        console.print(f"  {run.name}: {total_ms:.1f} ms = matmuls {matmul_ms:.1f} + the rest "
                      f"{total_ms - matmul_ms:.1f} (attention, norms, RoPE, Python){least}")


def _other_matmuls(routes, replayed, single: bool) -> str | None:
    """What multiplied a row's weights where that is not the replayed route (its time is then not split), else
    None: float32 weights or int8 codes multiplied as float32 by the replayed calls."""
    from kvserve.model.int8_kernels import FloatKernel

    int8_kernel = routes.int8_kernel
    int8_own = int8_kernel is not None and not isinstance(int8_kernel, FloatKernel)
    matmul = routes.float_matmul  # int8 weights: F.linear, as their codes are multiplied as float32 (FloatKernel)
    if routes.gemms:  # the template, over float weights or oneDNN's int8 ones (compile/steps.py, gemms_unused)
        return f"Inductor's GEMM template, not the replayed {replayed.name}"
    if int8_own and single and routes.one_row_loops:  # int8 codes, one row in the graph: model/linear.py, one_row_sums
        return f"Inductor's loops over the int8 codes on every core, not {int8_kernel.name}'s calls"
    if int8_own:
        return f"{int8_kernel.name}'s int8 ones"
    if matmul is not replayed:  # float weights by another route (or int8 codes as float32 by F.linear)
        return f"{matmul.name}'s, not the replayed {replayed.name}"
    if single and routes.one_row_loops:
        # float weights (float32, bfloat16), one row in the graph: model/linear.py, one_row_in_graph
        return f"Inductor's matrix-vector loops over every core, not the replayed {replayed.name}'s calls"
    return None
