"""`kvserve bench throughput`: the same synthetic requests through kvserve, transformers and llama.cpp, in one run.

Batched: N requests (prompt lengths uniform in [min, max], fixed output length, fixed seed). kvserve takes them
all at once (continuous batching); transformers runs padded static batches through `generate`; llama.cpp
(llama-cpp-python, the Q4_1 GGUF itself) runs them one after another, as its Python API serves one sequence.
Single stream: one request, decode tokens/s, and transformers with and without its KV cache.
Greedy decoding with EOS ignored everywhere, so every engine produces exactly the same number of tokens."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.plots import check_plot_path, plot_throughput

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    min_prompt_len: int = 64
    max_prompt_len: int = 512
    output_len: int = 128
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(self.min_prompt_len, self.max_prompt_len + 1, (self.num_requests,), generator=g)
        # stay clear of the special tokens at both ends of the vocabulary
        return [torch.randint(100, vocab_size - 100, (int(n),), generator=g).tolist() for n in lengths]


@dataclass(frozen=True)
class RunResult:
    name: str
    output_tokens: int
    seconds: float
    outputs: list[list[int]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_kvserve(llm, prompts: list[list[int]], output_len: int, name: str = "kvserve") -> RunResult:
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return RunResult(name, sum(map(len, tokens)), seconds, tokens)


def run_transformers(model, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int,
                     use_cache: bool = True, name: str = "transformers") -> RunResult:
    import torch

    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding, as generate wants
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, use_cache=use_cache, pad_token_id=pad_id)
        outputs.extend(out[:, width:].tolist())
    seconds = time.perf_counter() - start
    return RunResult(name, sum(map(len, outputs)), seconds, outputs)


def run_llama_cpp(prompts: list[list[int]], output_len: int, n_ctx: int, name: str) -> RunResult | str:
    """A RunResult, or the reason llama.cpp could not run here."""
    import torch

    from kvserve.bench.llama_cpp_baseline import run_in_child

    result = run_in_child(prompts, output_len, n_ctx, torch.get_num_threads())
    if "error" in result:
        return result["error"]
    return RunResult(name, sum(map(len, result["outputs"])), result["seconds"], result["outputs"])


def load_transformers(path, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def agreement(a: RunResult, b: RunResult) -> float:
    """Fraction of requests whose greedy tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs)) / len(a.outputs)


def add_throughput_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("throughput", help="batched and single-stream tokens/s vs transformers and llama.cpp")
    w = Workload()
    p.add_argument("--num-requests", type=int, default=w.num_requests)
    p.add_argument("--min-prompt-len", type=int, default=w.min_prompt_len)
    p.add_argument("--max-prompt-len", type=int, default=w.max_prompt_len)
    p.add_argument("--output-len", type=int, default=w.output_len)
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="kvserve runs once per dtype (transformers always runs float32: its fastest on CPU)")
    p.add_argument("--profile", action="store_true",
                   help="also print where kvserve's batched run spends its time (cProfile, top functions)")
    p.add_argument("--skip", nargs="*", default=[], choices=["transformers", "llama.cpp", "single"],
                   help="leave out a baseline or the single-stream part")
    p.add_argument("--model", default=None,
                   help="default: the embedded SmolLM2-135M-Instruct (llama.cpp always runs the embedded GGUF)")
    p.add_argument("--kv-cache-memory", default=None, help="kvserve's KV cache size (default: the engine's, 1GiB)")
    p.add_argument("--plot", metavar="PATH", help="also draw tokens/s per engine (.png or .svg)")
    p.set_defaults(func=run_throughput)


def run_throughput(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvserve.engine.llm import LLM

    if args.plot:
        try:
            check_plot_path(args.plot)
        except ValueError as exc:
            raise SystemExit(f"kvserve bench throughput: {exc}") from exc
    console = Console(width=150)
    workload = Workload(args.num_requests, args.min_prompt_len, args.max_prompt_len, args.output_len, args.seed)
    max_len = workload.max_prompt_len + workload.output_len
    llms = {dtype: LLM(args.model, dtype=dtype, max_model_len=max(max_len, 1024), kv_cache_memory=args.kv_cache_memory,
                       max_num_seqs=max(workload.num_requests, 1))
            for dtype in args.dtypes}
    engine = next(iter(llms.values())).engine
    prompts = workload.prompts(engine.model_config.vocab_size)
    console.print(f"workload: {len(prompts)} requests, prompts {workload.min_prompt_len}-{workload.max_prompt_len} "
                  f"tokens ({sum(map(len, prompts)):,} in all), {workload.output_len} output tokens each, "
                  f"greedy, EOS ignored; torch threads: {torch.get_num_threads()}")
    run_llama = "llama.cpp" not in args.skip and _llama_cpp_ready(console)
    hf = None
    if "transformers" not in args.skip:
        hf = load_transformers(engine.model_path, torch.float32)
        tokenizer = engine.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        run_transformers(hf, prompts[:2], 4, 2, pad_id)  # warm-up
    for llm in llms.values():
        run_kvserve(llm, prompts[:2], 4)  # warm-up

    batched = [_maybe_profiled(args.profile, console, run_kvserve, llm, prompts, workload.output_len,
                               f"kvserve ({dtype})") for dtype, llm in llms.items()]
    if hf is not None:
        batched.append(run_transformers(hf, prompts, workload.output_len, args.hf_batch_size, pad_id,
                                        name="transformers"))
    if run_llama:
        batched.append(run_llama_cpp(prompts, workload.output_len, max_len, "llama.cpp"))
    _print_table(console, "Batched throughput (output tokens/s)", batched)
    if hf is not None:
        console.print(f"transformers: float32, generate() on left-padded static batches of {args.hf_batch_size}")
    if run_llama:
        console.print("llama.cpp: llama-cpp-python on the Q4_1 GGUF, one request after another")
    if hf is not None:
        for r in batched[: len(llms)]:
            console.print(f"{r.name}: greedy output identical to transformers for {agreement(r, batched[len(llms)]):.0%}"
                          " of requests")
    singles = []
    if "single" not in args.skip:
        single = prompts[:1]
        singles = [run_kvserve(llm, single, workload.output_len, f"kvserve ({dtype})") for dtype, llm in llms.items()]
        if hf is not None:
            for use_cache in (True, False):
                singles.append(run_transformers(hf, single, workload.output_len, 1, pad_id, use_cache,
                                                "transformers" if use_cache else "transformers, no KV cache"))
        if run_llama:
            singles.append(run_llama_cpp(single, workload.output_len, max_len, "llama.cpp"))
        _print_table(console, f"Single stream ({len(single[0])}-token prompt, tokens/s incl. prefill)", singles)
    if args.plot:
        plot_throughput(args.plot, _speeds(batched), _speeds(singles))
        console.print(f"plot written to {args.plot}")
    return 0


def _speeds(results: list[RunResult | str]) -> dict[str, float]:
    """Tokens/s of the engines that ran (a str is one that could not)."""
    return {r.name: r.tokens_per_s for r in results if isinstance(r, RunResult)}


def _llama_cpp_ready(console) -> bool:
    from kvserve.bench.llama_cpp_baseline import NOT_INSTALLED, llama_cpp_installed

    if llama_cpp_installed():
        return True
    console.print(f"llama.cpp: {NOT_INSTALLED}", markup=False)  # as markup, '[bench]' would vanish
    return False


def _maybe_profiled(profile: bool, console, fn, *args):
    if not profile:
        return fn(*args)
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    result = profiler.runcall(fn, *args)
    stats = pstats.Stats(profiler).sort_stats("tottime")
    total = sum(row[2] for row in stats.stats.values())  # tottime summed over all functions
    console.print(f"{result.name}: share of time by function (cProfile tottime)")
    for (file, line, name), row in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:8]:
        console.print(f"  {row[2] / total:6.1%}  {name}  ({file.rsplit('/', 1)[-1]}:{line})")
    return result


def _print_table(console, title: str, results: list[RunResult | str]) -> None:
    """One row per engine, with its speed relative to each baseline that ran (a str is one that could not)."""
    from rich.table import Table

    baselines = [r for r in results if isinstance(r, RunResult) and not r.name.startswith("kvserve")]
    table = Table(title=title)
    for column in ["engine", "output tokens", "seconds", "tokens/s"] + [f"÷ {b.name}" for b in baselines]:
        table.add_column(column, justify="left" if column == "engine" else "right")
    for r in results:
        if isinstance(r, str):
            table.add_row(f"did not run: {r}", *["-"] * (3 + len(baselines)))
            continue
        ratios = [f"{r.tokens_per_s / b.tokens_per_s:.2f}x" for b in baselines]
        table.add_row(r.name, f"{r.output_tokens:,}", f"{r.seconds:.1f}", f"{r.tokens_per_s:.1f}", *ratios)
    console.print(table)
