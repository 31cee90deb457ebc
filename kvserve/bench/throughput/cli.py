"""The `kvserve bench throughput` command: its flags, the checks on their values, and the run in order (kvserve's
configurations round after round with their baselines beside them, then each workload's report and the single
stream's)."""
from __future__ import annotations

import argparse

from kvserve.bench.hybrid_model import add_hybrid_model_argument, resolve_hybrid_model_argument
from kvserve.bench.throughput import runners
from kvserve.bench.throughput.configs import KvserveConfig, kvserve_configs, option_values
from kvserve.bench.throughput.report import (cpu_name, print_rounds, print_single_stream, print_speculation,
                                             print_transformers_rounds, print_workload, speeds)
from kvserve.bench.throughput.results import RunResult, median_run
from kvserve.bench.throughput.workloads import (LONG_CONTEXT_KV_MEMORY, WORKLOADS, Workload, kv_cache_memory,
                                                selected_workloads)
from kvserve.config import DEFAULT_BLOCK_SIZE, DEFAULT_DISABLE_BY_BATCH_SIZE
from kvserve.plots import check_plot_path, plot_throughput


def add_throughput_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("throughput", help="batched and single-stream tokens/s vs transformers and llama.cpp")
    w = Workload()
    p.add_argument("--num-requests", type=int, default=w.num_requests, help="decode-heavy workload")
    p.add_argument("--min-prompt-len", type=int, default=w.min_prompt_len, help="decode-heavy workload")
    p.add_argument("--max-prompt-len", type=int, default=w.max_prompt_len, help="decode-heavy workload")
    p.add_argument("--output-len", type=int, default=w.output_len, help="decode-heavy workload")
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--workloads", nargs="+", default=["decode", "prefill"], metavar="NAME",
                   help=f"of {', '.join(WORKLOADS)} (default: decode prefill); long-context runs kvserve only")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="kvserve runs once per dtype (transformers runs --hf-dtype)")
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="transformers' weights (default float32, its fastest on CPU for plain decoders; a hybrid "
                        "model's torch fallback can be faster in bfloat16: compare both)")
    p.add_argument("--quantization", nargs="+", default=["none"], metavar="Q",
                   help="kvserve's weights, e.g. none int8 (or none,int8); one run per value (default: none)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], metavar="FORMAT",
                   help="kvserve's KV storage, e.g. auto,fp8,int8,int4; one run per value (default: auto)")
    p.add_argument("--block-size", nargs="+", type=int, default=[DEFAULT_BLOCK_SIZE], metavar="TOKENS",
                   help="kvserve's KV block size; one run per value, e.g. 16 64 to price a larger block in the "
                        "same run (default: the engine's %(default)s)")
    p.add_argument("--kv-eviction", nargs="+", default=["none"], metavar="POLICY",
                   help="KV eviction policies (none, streaming, h2o, perhead-span, ...), each its own row: what "
                        "compression costs in speed at the same batch")
    p.add_argument("--kv-budget-tokens", type=int, default=128, metavar="N",
                   help="with --kv-eviction: tokens each sequence (per-head policies: each KV head) keeps")
    p.add_argument("--kv-recent-tokens", type=int, default=32, metavar="N",
                   help="with --kv-eviction: the recent window always kept")
    p.add_argument("--batch-invariant", nargs="+", default=["off"], metavar="MODE",
                   help="kvserve's --batch-invariant: off, on, or off on (one run per value) to price the mode "
                        "against the default in the same run (default: off)")
    p.add_argument("--compile-decode", nargs="+", default=["default"], metavar="MODE",
                   help="kvserve's decode steps: default (the engine's: compiled where supported), off (eager, "
                        "--no-compile-decode), on (compiled, --compile-decode), gemms (compiled with --compile-gemms), "
                        "or several: a row each in the same run (default: default)")
    p.add_argument("--speculative", nargs="+", default=["off"], metavar="METHOD",
                   help="kvserve's --speculative-config method: off, ngram, suffix (one run per value; default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens per step with --speculative ngram/suffix (default %(default)s)")
    p.add_argument("--disable-by-batch-size", type=int, nargs="+", default=[DEFAULT_DISABLE_BY_BATCH_SIZE],
                   metavar="N", help="speculate only while at most N sequences decode in a step (default "
                                     "%(default)s); one run per value, to measure where speculation stops paying")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the kvserve configurations N times, interleaved (round by round), and show each one's "
                        "median run and its ratio to the first configuration in every round, so that a slow spell "
                        "on a noisy machine weighs on every configuration alike")
    p.add_argument("--constrained-share", type=float, default=0.0, metavar="F",
                   help="also run the decode-heavy workload with a share F (0 to 1) of its requests JSON-schema "
                        "constrained, beside the same requests unconstrained (which goes first alternates round by "
                        "round: use an even --repeat), and print tokens/s of the mix over unconstrained and the "
                        "grammar's compile time (default 0: not run)")
    p.add_argument("--profile", action="store_true",
                   help="also print where each kvserve run (batched and single stream) spends its time (cProfile, "
                        "top functions)")
    p.add_argument("--skip", nargs="*", default=[], choices=["transformers", "llama.cpp", "single", "roofline"],
                   help="leave out a baseline, the single-stream part or the roofline")
    p.add_argument("--model", default=None,
                   help="default: the embedded SmolLM2-135M-Instruct (llama.cpp always runs the embedded GGUF)")
    add_hybrid_model_argument(p)
    p.add_argument("--phases", action="store_true",
                   help="also time transformers' prefill apart (each batch's time to its first logits), for a prefill "
                        "tokens/s column and transformers' decode tokens/s, and print kvserve's ratios to both")
    p.add_argument("--kv-cache-memory", default=None,
                   help=f"kvserve's KV cache size (default: the engine's 1GiB; {LONG_CONTEXT_KV_MEMORY} with "
                        "long-context)")
    p.add_argument("--plot", metavar="PATH", help="also draw tokens/s per engine (.png or .svg)")
    p.set_defaults(func=run_throughput)


def run_throughput(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    _check_options(args)
    configs = kvserve_configs(args)
    console = Console(width=170)
    decode_heavy = Workload(args.num_requests, args.min_prompt_len, args.max_prompt_len, args.output_len, args.seed)
    workloads = selected_workloads(option_values(args.workloads), decode_heavy)
    console.print(f"torch threads: {torch.get_num_threads()}; greedy, EOS ignored; CPU: {cpu_name()}")
    _hybrid_model(args, console)
    run_llama = "llama.cpp" not in args.skip and runners.llama_cpp_ready(console)
    runs = runners.KvserveRuns(args, workloads, kv_cache_memory(args.kv_cache_memory, workloads), console,
                               paired_llama_cpp=run_llama)
    hf = runners.TransformersRuns(workloads if "transformers" not in args.skip else {}, args.phases, args.hf_dtype)
    if args.hf_dtype != "float32" and "transformers" not in args.skip:
        console.print(f"transformers: {args.hf_dtype} weights (--hf-dtype)", highlight=False)
    for _ in range(args.repeat):
        for config in configs:
            runs.run(config)
        hf.run_round(runs, args.hf_batch_size)
    rounds = runs.keep_medians(len(configs))
    for name, workload in workloads.items():
        rows = _batched_rows(name, runs, hf, run_llama)
        print_workload(console, workload, rows, len(configs), runs.model_config,
                       args.hf_batch_size if hf.model is not None else None, "roofline" not in args.skip,
                       args.hf_dtype)
        print_speculation(console, rows)
        print_rounds(console, rounds[name])
        print_transformers_rounds(console, rounds[name], hf.rounds.get(name, []))
        if name == "decode" and runs.constrained is not None:
            runs.constrained.print(console)
    if runs.singles:
        _single_stream(console, args, configs, runs, hf, run_llama, rounds["single stream"])
    if args.plot:
        plot_throughput(args.plot, speeds(runs.batched[next(iter(workloads))]), speeds(runs.singles))
        console.print(f"plot written to {args.plot}")
    return 0


def _hybrid_model(args: argparse.Namespace, console) -> None:
    """With --hybrid-model: its directory in args.model, and the baselines that cannot run it left out, saying why."""
    if not args.hybrid_model:
        return
    resolve_hybrid_model_argument(args, console)
    console.print("llama.cpp: left out (it runs the embedded GGUF, not this model); roofline: left out (its matmul "
                  "shapes are a plain decoder's)", highlight=False, soft_wrap=True)
    args.skip = [*args.skip, "llama.cpp", "roofline"]
    if "transformers" not in args.skip:
        from transformers.utils.import_utils import is_flash_linear_attention_available

        fast = is_flash_linear_attention_available()
        console.print(f"transformers: Gated DeltaNet through "
                      f"{'flash-linear-attention' if fast else 'its torch fallback (no flash-linear-attention)'}",
                      highlight=False, soft_wrap=True)


def _check_options(args: argparse.Namespace) -> None:
    """The --plot path, --repeat and --workloads, checked before anything loads (the configurations: configs.py)."""
    if args.plot:
        try:
            check_plot_path(args.plot)
        except ValueError as exc:
            raise SystemExit(f"kvserve bench throughput: {exc}") from exc
    if not 0 <= args.constrained_share <= 1:
        raise SystemExit(f"kvserve bench throughput: --constrained-share must be in [0, 1], got "
                         f"{args.constrained_share}")
    if args.repeat < 1:
        raise SystemExit(f"kvserve bench throughput: --repeat must be at least 1, got {args.repeat}")
    unknown = [w for w in option_values(args.workloads) if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"kvserve bench throughput: unknown workload {unknown[0]!r}; choose from "
                         f"{', '.join(WORKLOADS)}")


def _batched_rows(name: str, runs: runners.KvserveRuns, hf: runners.TransformersRuns,
                  run_llama: bool) -> list[RunResult | str]:
    """A workload's kvserve rows followed by its baselines' (long-context runs kvserve only): transformers' median
    round, then llama.cpp serial and batched, run now."""
    rows, prompts, workload = runs.batched[name], runs.prompts[name], runs.workloads[name]
    if name == "long-context":
        return rows
    if hf.model is not None:
        rows.append(median_run(hf.rounds[name]))
    if run_llama:
        n_ctx = workload.max_len
        rows.append(runners.run_llama_cpp(prompts, workload.output_len, n_ctx, "llama.cpp (serial)"))
        rows.append(runners.run_llama_cpp(prompts, workload.output_len, n_ctx, "llama.cpp (batched)", True))
    return rows


def _single_stream(console, args: argparse.Namespace, configs: list[KvserveConfig], runs: runners.KvserveRuns,
                   hf: runners.TransformersRuns, run_llama: bool, rounds: list[list[RunResult]]) -> None:
    """The single stream's baselines, run now (llama.cpp's: the median of its runs beside kvserve's, and its own
    speculation against kvserve's), and its report."""
    prompts = runs.single_prompts()
    output_len = next(iter(runs.workloads.values())).output_len
    singles = runs.singles
    if hf.model is not None:
        singles.extend(hf.single_stream(prompts, output_len))
    if run_llama:
        singles.append(runs.llama_cpp_median())
        methods = option_values(args.speculative)
        if "off" not in methods or len(methods) > 1:  # against kvserve's speculation: llama.cpp's own
            singles.append(runners.run_llama_cpp_lookup(prompts, output_len))
    print_single_stream(console, prompts, output_len, singles, len(configs), rounds, runs.paired, runs.model_config,
                        "roofline" not in args.skip)
