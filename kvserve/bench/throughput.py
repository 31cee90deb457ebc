"""`kvserve bench throughput`: the same synthetic requests through kvserve, transformers and llama.cpp, in one run.

Workloads (fixed seed, greedy, EOS ignored everywhere, so every engine produces exactly the same number of tokens):
decode-heavy (N requests, prompt lengths uniform in [min, max], long outputs: the --num-requests ... options),
prefill-heavy (12 prompts of 50-400 tokens, 48 new tokens each) and long-context (16 requests of 4,096-token
prompts, 32 new tokens each: decode reads a lot of KV per token). kvserve runs once per configuration
(--dtypes x --quantization x --kv-cache-dtype), taking all requests at once (continuous batching);
transformers runs padded static batches through `generate`; llama.cpp (llama-cpp-python on the Q4_1 GGUF) runs
them one after another and, through its batch API, all at once. Single stream: one request, tokens/s.
With --repeat N the kvserve configurations run round after round, transformers' batched runs at the end of each
round and llama.cpp's single stream right after each of kvserve's: every ratio is also given run by run against
the baseline run beside it (the machine's speed drifts over minutes).
A roofline line per workload compares each kvserve run's matmul FLOP/s with float32 matmuls of the same shapes
replayed in the same run, multiplied as the engine multiplies float32 (kvserve/bench/roofline.py)."""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvserve.bench.rewrite import RewriteWorkload
from kvserve.config import DEFAULT_BLOCK_SIZE, DEFAULT_DISABLE_BY_BATCH_SIZE
from kvserve.plots import check_plot_path, plot_throughput

if TYPE_CHECKING:
    import torch

LOOKUP_ROOM = 16  # context llama-cpp-python's prompt lookup needs past the last token (its 10 drafts and 1)
LONG_CONTEXT_KV_MEMORY = "4GiB"  # 16 x 4,128 tokens of SmolLM2's float32 KV (45 KiB/token) is 2.9 GiB


@dataclass(frozen=True)
class Workload:
    num_requests: int = 32
    min_prompt_len: int = 64
    max_prompt_len: int = 512
    output_len: int = 128
    seed: int = 0
    name: str = "decode-heavy"

    def prompts(self, vocab_size: int, tokenizer=None) -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(self.min_prompt_len, self.max_prompt_len + 1, (self.num_requests,), generator=g)
        # stay clear of the special tokens at both ends of the vocabulary
        return [torch.randint(100, vocab_size - 100, (int(n),), generator=g).tolist() for n in lengths]

    @property
    def max_len(self) -> int:
        return self.max_prompt_len + self.output_len

    def describe(self, prompts: list[list[int]]) -> str:
        return (f"{self.name}: {len(prompts)} requests, prompts {self.min_prompt_len}-{self.max_prompt_len} tokens "
                f"({sum(map(len, prompts)):,} in all), {self.output_len} output tokens each")


PREFILL_HEAVY = Workload(12, 50, 400, 48, name="prefill-heavy")
LONG_CONTEXT = Workload(16, 4096, 4096, 32, name="long-context")
WORKLOADS = ("decode", "prefill", "long-context", "rewrite")
SPECULATIVE_METHODS = ("off", "ngram", "suffix")


@dataclass(frozen=True)
class Routes:
    """How a kvserve row's engine multiplied its weights and ran its decode steps, read from the engine itself: what
    the decode split compares with the matmuls it replays."""
    float_matmul: object  # model/float_kernels.py: what multiplied float weights (int8 weights: F.linear, unused)
    int8_kernel: object | None  # model/int8_kernels.py: what multiplied int8 weights (None: float weights)
    compiled: bool  # --compile-decode: a graph was built for decode steps (compile/steps.py)
    gemms: bool  # ... with --compile-gemms applied (Inductor's GEMM template)
    one_row_loops: bool = False  # ... whose one-row steps multiply float weights in loops of its own (Linears)

    @classmethod
    def of(cls, engine) -> Routes:
        linears, compiled = engine.model.linears, engine.runner.compiled
        return cls(linears.matmul, linears.kernel, compiled is not None, compiled is not None and compiled.gemms,
                   compiled is not None and linears.one_row_loops)


@dataclass(frozen=True)
class RunResult:
    name: str
    output_tokens: int
    seconds: float
    outputs: list[list[int]] | None = None
    decode_tokens: int = 0  # tokens sampled in steps that prefilled nothing ...
    decode_seconds: float = 0.0  # ... and the time of those steps (kvserve only)
    steps: Counter = field(default_factory=Counter)  # (tokens, sampled rows) -> steps of that shape (kvserve)
    prefill_tokens: int = 0  # prompt tokens computed, not found in the prefix cache (kvserve)
    draft_tokens: int = 0  # speculative decoding (kvserve): draft tokens verified ...
    accepted_tokens: int = 0  # ... accepted ...
    drafts: int = 0  # ... in this many verifications
    decode_steps: int = 0  # steps that prefilled nothing (kvserve) ...
    compiled_steps: int = 0  # ... and those of them that ran a compiled graph (--compile-decode)
    # the least the decode-only steps' attention reads: each sequence's K/V over its whole context once a step, in the
    # KV format's bytes a token (kvserve; every layer over every key: a sliding layer would read less)
    decode_kv_bytes: int = 0
    routes: Routes | None = None  # how its engine multiplied and ran decode steps (kvserve)
    prefill_steps: int = 0  # steps with prompt tokens (kvserve) ...
    compiled_prefill_steps: int = 0  # ... and those of them that ran a compiled graph

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else None


def run_kvserve(llm, prompts: list[list[int]], output_len: int, name: str = "kvserve") -> RunResult:
    """All prompts at once, stepping the engine to time decode-only steps and record each step's shape."""
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    lengths = dict.fromkeys(ids, 0)
    outputs: dict[str, list[int]] = {}
    steps: Counter = Counter()
    decode_tokens, decode_seconds, decode_steps, decode_keys = 0, 0.0, 0, 0
    compiled = {True: 0, False: 0}  # steps that ran a compiled graph, by whether they prefilled
    prompt_lens = {request_id: len(prompt) for request_id, prompt in zip(ids, prompts)}
    prefill_start = engine.num_prefill_tokens
    spec_start = _spec_counts(engine)
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        prefilled, decoded = engine.num_prefill_tokens, engine.num_decode_tokens
        compiled_before = engine.runner.num_compiled_steps
        step_start = time.perf_counter()
        step_outputs = engine.step()
        step_seconds = time.perf_counter() - step_start
        sampled, keys = 0, 0
        for output in step_outputs:
            token_ids = output.outputs[0].token_ids
            sampled += len(token_ids) - lengths[output.request_id]
            if len(token_ids) > lengths[output.request_id]:  # its newest token's step attended over all before it
                keys += prompt_lens[output.request_id] + len(token_ids) - 1
            lengths[output.request_id] = len(token_ids)
            if output.finished:
                outputs[output.request_id] = list(token_ids)
        prefilled = engine.num_prefill_tokens - prefilled
        steps[(prefilled + engine.num_decode_tokens - decoded, sampled)] += 1
        compiled[prefilled > 0] += engine.runner.num_compiled_steps - compiled_before
        if not prefilled:
            decode_tokens += sampled
            decode_seconds += step_seconds
            decode_steps += 1
            decode_keys += keys
    seconds = time.perf_counter() - start
    tokens = [outputs[i] for i in ids]
    spec = [b - a for a, b in zip(spec_start, _spec_counts(engine))]
    return RunResult(name, sum(map(len, tokens)), seconds, tokens, decode_tokens, decode_seconds, steps,
                     engine.num_prefill_tokens - prefill_start, *spec, decode_steps, compiled[False],
                     decode_keys * engine.cache_plan.kv_bytes_per_token, Routes.of(engine),
                     sum(steps.values()) - decode_steps, compiled[True])


def run_kvserve_serial(llm, prompts: list[list[int]], output_len: int, name: str = "kvserve") -> RunResult:
    """One request after another (a single stream over several prompts), summed."""
    runs = [run_kvserve(llm, [prompt], output_len, name) for prompt in prompts]
    total = lambda field_name: sum(getattr(r, field_name) for r in runs)  # noqa: E731
    return RunResult(name, total("output_tokens"), total("seconds"), [r.outputs[0] for r in runs],
                     total("decode_tokens"), total("decode_seconds"), sum((r.steps for r in runs), Counter()),
                     total("prefill_tokens"), total("draft_tokens"), total("accepted_tokens"), total("drafts"),
                     total("decode_steps"), total("compiled_steps"), total("decode_kv_bytes"), runs[0].routes,
                     total("prefill_steps"), total("compiled_prefill_steps"))


def _reset(llm) -> None:
    """Before a timed run: no cached prefix, and no earlier run's answers for suffix decoding to find."""
    llm.reset_prefix_cache()
    if llm.engine.speculator is not None:
        llm.engine.speculator.forget_outputs()


def _spec_counts(engine) -> tuple[int, int, int]:
    if engine.speculator is None:
        return 0, 0, 0
    stats = engine.speculator.stats
    return stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts


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


def run_llama_cpp(prompts: list[list[int]], output_len: int, n_ctx: int, name: str,
                  batched: bool = False, lookup: bool = False) -> RunResult | str:
    """A RunResult, or the reason llama.cpp could not run here. `lookup`: serial, with its prompt lookup decoding."""
    import torch

    from kvserve.bench.llama_cpp_baseline import run_in_child

    result = run_in_child(prompts, output_len, n_ctx, torch.get_num_threads(), batched, lookup)
    if "error" in result:
        return result["error"]
    return RunResult(name, sum(map(len, result["outputs"])), result["seconds"], result["outputs"])


def load_transformers(path, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def agreement(a: RunResult, b: RunResult) -> float:
    """Fraction of requests whose greedy tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs)) / len(a.outputs)


def _names(values: list[str]) -> list[str]:
    """Space- or comma-separated option values ("auto,int8" or "auto int8")."""
    return [v for value in values for v in value.split(",") if v]


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
                   help="kvserve runs once per dtype (transformers always runs float32: its fastest on CPU)")
    p.add_argument("--quantization", nargs="+", default=["none"], metavar="Q",
                   help="kvserve's weights, e.g. none int8 (or none,int8); one run per value (default: none)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], metavar="FORMAT",
                   help="kvserve's KV storage, e.g. auto,fp8,int8,int4; one run per value (default: auto)")
    p.add_argument("--block-size", nargs="+", type=int, default=[DEFAULT_BLOCK_SIZE], metavar="TOKENS",
                   help="kvserve's KV block size; one run per value, e.g. 16 64 to price a larger block in the "
                        "same run (default: the engine's %(default)s)")
    p.add_argument("--batch-invariant", nargs="+", default=["off"], metavar="MODE",
                   help="kvserve's --batch-invariant: off, on, or off on (one run per value) to price the mode "
                        "against the default in the same run (default: off)")
    p.add_argument("--compile-decode", nargs="+", default=["off"], metavar="MODE",
                   help="kvserve's --compile-decode: off (eager decode steps), on (one compiled graph), gemms (the "
                        "graph with --compile-gemms), or several: a row each in the same run (default: off)")
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
    p.add_argument("--profile", action="store_true",
                   help="also print where each kvserve run (batched and single stream) spends its time (cProfile, "
                        "top functions)")
    p.add_argument("--skip", nargs="*", default=[], choices=["transformers", "llama.cpp", "single", "roofline"],
                   help="leave out a baseline, the single-stream part or the roofline")
    p.add_argument("--model", default=None,
                   help="default: the embedded SmolLM2-135M-Instruct (llama.cpp always runs the embedded GGUF)")
    p.add_argument("--kv-cache-memory", default=None,
                   help=f"kvserve's KV cache size (default: the engine's 1GiB; {LONG_CONTEXT_KV_MEMORY} with "
                        "long-context)")
    p.add_argument("--plot", metavar="PATH", help="also draw tokens/s per engine (.png or .svg)")
    p.set_defaults(func=run_throughput)


@dataclass(frozen=True)
class _Config:
    dtype: str
    quantization: str
    kv_cache_dtype: str
    batch_invariant: bool = False
    speculative: str = "off"
    num_speculative_tokens: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    compile_decode: bool = False
    compile_gemms: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def name(self) -> str:
        extras = ([f"{self.quantization} weights"] if self.quantization != "none" else []) + \
            ([f"KV {self.kv_cache_dtype}"] if self.kv_cache_dtype != "auto" else []) + \
            ([f"blocks of {self.block_size}"] if self.block_size != DEFAULT_BLOCK_SIZE else []) + \
            (["batch-invariant"] if self.batch_invariant else []) + \
            ([f"{self.speculative} k={self.num_speculative_tokens}"] if self.speculative != "off" else []) + \
            ([f"off above {self.disable_by_batch_size}"] if self.disable_by_batch_size != DEFAULT_DISABLE_BY_BATCH_SIZE
             and self.speculative != "off" else []) + \
            (["compiled decode"] if self.compile_decode else []) + (["compiled GEMMs"] if self.compile_gemms else [])
        return f"kvserve ({', '.join([self.dtype, *extras])})"

    @property
    def speculative_config(self) -> dict | None:
        if self.speculative == "off":
            return None
        return {"method": self.speculative, "num_speculative_tokens": self.num_speculative_tokens,
                "disable_by_batch_size": self.disable_by_batch_size}


def run_throughput(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvserve.config import EngineConfig

    if args.plot:
        try:
            check_plot_path(args.plot)
        except ValueError as exc:
            raise SystemExit(f"kvserve bench throughput: {exc}") from exc
    if args.repeat < 1:
        raise SystemExit(f"kvserve bench throughput: --repeat must be at least 1, got {args.repeat}")
    unknown = [w for w in _names(args.workloads) if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"kvserve bench throughput: unknown workload {unknown[0]!r}; choose from "
                         f"{', '.join(WORKLOADS)}")
    modes = _names(args.batch_invariant)
    if set(modes) - {"off", "on"}:
        raise SystemExit(f"kvserve bench throughput: --batch-invariant takes off and/or on, got {args.batch_invariant}")
    compile_modes = _names(args.compile_decode)
    if not compile_modes or set(compile_modes) - {"off", "on", "gemms"}:
        raise SystemExit(f"kvserve bench throughput: --compile-decode takes off, on and/or gemms, got "
                         f"{args.compile_decode}")
    methods = _names(args.speculative)
    if set(methods) - set(SPECULATIVE_METHODS):
        raise SystemExit(f"kvserve bench throughput: --speculative takes {', '.join(SPECULATIVE_METHODS)}, got "
                         f"{args.speculative}")
    configs = [_Config(d, q, kv, mode == "on", method, args.num_speculative_tokens, limit, compiled != "off",
                       compiled == "gemms", block)
               for d in args.dtypes for q in _names(args.quantization) for kv in _names(args.kv_cache_dtype)
               for block in dict.fromkeys(args.block_size) for mode in modes for method in methods
               for limit in (args.disable_by_batch_size if method != "off" else [DEFAULT_DISABLE_BY_BATCH_SIZE])
               for compiled in compile_modes]
    for c in configs:  # bad values fail here, naming the choices, before anything loads
        try:
            EngineConfig(dtype=c.dtype, quantization=c.quantization, kv_cache_dtype=c.kv_cache_dtype,
                         speculative_config=c.speculative_config, block_size=c.block_size)
        except ValueError as exc:
            raise SystemExit(f"kvserve bench throughput: {exc}") from exc
    console = Console(width=170)
    workloads = {"decode": Workload(args.num_requests, args.min_prompt_len, args.max_prompt_len, args.output_len,
                                    args.seed), "prefill": PREFILL_HEAVY, "long-context": LONG_CONTEXT,
                 "rewrite": RewriteWorkload()}
    workloads = {name: workloads[name] for name in dict.fromkeys(_names(args.workloads))}
    kv_memory = args.kv_cache_memory or (LONG_CONTEXT_KV_MEMORY if "long-context" in workloads else None)
    console.print(f"torch threads: {torch.get_num_threads()}; greedy, EOS ignored; CPU: {_cpu_name()}")
    run_llama = "llama.cpp" not in args.skip and _llama_cpp_ready(console)
    runs = _KvserveRuns(args, workloads, kv_memory, console, paired_llama_cpp=run_llama)
    hf, pad_id = None, 0
    # transformers' batched runs, one per workload at the end of each round, beside that round's kvserve runs: the
    # machine's speed drifts over minutes, and a ratio over one transformers run made after every round carried it
    hf_rounds: dict[str, list[RunResult]] = ({name: [] for name in workloads if name != "long-context"}
                                             if "transformers" not in args.skip else {})
    for _ in range(args.repeat):
        for config in configs:
            runs.run(config)
        if hf_rounds and hf is None:
            hf, pad_id = load_transformers(runs.model_path, torch.float32), runs.pad_id
            run_transformers(hf, runs.prompts[next(iter(hf_rounds))][:2], 4, 2, pad_id)  # warm-up
        for name, hf_runs in hf_rounds.items():
            hf_runs.append(run_transformers(hf, runs.prompts[name], workloads[name].output_len, args.hf_batch_size,
                                            pad_id))
    rounds = runs.keep_medians(len(configs))
    prompts, batched, singles = runs.prompts, runs.batched, runs.singles
    for name, workload in workloads.items():
        rows = batched[name]
        if name != "long-context":
            if hf is not None:
                rows.append(_median(hf_rounds[name]))
            if run_llama:
                n_ctx = workload.max_len
                rows.append(run_llama_cpp(prompts[name], workload.output_len, n_ctx, "llama.cpp (serial)"))
                rows.append(run_llama_cpp(prompts[name], workload.output_len, n_ctx, "llama.cpp (batched)", True))
        _report_workload(console, args, workload, rows, len(configs), runs.model_config, hf is not None)
        _print_speculation(console, rows)
        _print_rounds(console, rounds[name])
        _print_transformers_rounds(console, rounds[name], hf_rounds.get(name, []))
    if singles:
        single = runs.single_prompts()
        output_len = next(iter(workloads.values())).output_len
        if hf is not None:
            for use_cache in (True, False):
                singles.append(run_transformers(hf, single, output_len, 1, pad_id, use_cache,
                                                "transformers" if use_cache else "transformers, no KV cache"))
        if run_llama:
            n_ctx = max(map(len, single)) + output_len
            singles.append(runs.llama_cpp_median())
            if "off" not in methods or len(methods) > 1:  # against kvserve's speculation: llama.cpp's own
                # (its draft's logits need room past the last token: 10 draft tokens + 1)
                singles.append(run_llama_cpp(single, output_len, n_ctx + LOOKUP_ROOM, "llama.cpp + prompt lookup",
                                             lookup=True))
        shape = (f"{len(single[0])}-token prompt" if len(single) == 1 else
                 f"{len(single)} prompts of {min(map(len, single))}-{max(map(len, single))} tokens one after another")
        _print_table(console, f"Single stream ({shape}, {output_len} new tokens each; tokens/s incl. prefill)",
                     singles)
        _print_speculation(console, singles)
        _print_compiled_steps(console, singles[: len(configs)])
        _print_rounds(console, rounds["single stream"])
        _print_llama_cpp_pairs(console, rounds["single stream"], runs.paired)
        if "roofline" not in args.skip:
            _print_decode_split(console, singles[: len(configs)], runs.model_config)
    if args.plot:
        plot_throughput(args.plot, _speeds(batched[next(iter(workloads))]), _speeds(singles))
        console.print(f"plot written to {args.plot}")
    return 0


class _KvserveRuns:
    """kvserve's rows: each configuration's engine is built, run on every workload (and one stream), then freed,
    so that no more than one engine's weights and KV cache are in memory. With `paired_llama_cpp`, llama.cpp's
    single stream runs right after each of kvserve's: this machine's speed drifts by a quarter over tens of seconds,
    so only runs side by side compare (docs/benchmarks.md, "Single streams side by side")."""

    def __init__(self, args, workloads: dict[str, Workload], kv_memory, console, paired_llama_cpp: bool = False):
        self.args, self.workloads, self.kv_memory, self.console = args, workloads, kv_memory, console
        self.paired_llama_cpp = paired_llama_cpp
        self.paired: list[RunResult | str] = []  # llama.cpp's single stream after each of self.singles
        self.max_len = max(max(w.max_len for w in workloads.values()), 1024)
        self.num_seqs = max(w.num_requests for w in workloads.values())
        self.prompts: dict[str, list[list[int]]] = {}
        self.batched: dict[str, list[RunResult | str]] = {name: [] for name in workloads}
        self.singles: list[RunResult | str] = []

    def run(self, config: _Config) -> None:
        from kvserve.engine.llm import LLM

        llm = LLM(self.args.model, dtype=config.dtype, quantization=config.quantization,
                  kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size, max_model_len=self.max_len,
                  kv_cache_memory=self.kv_memory,
                  max_num_seqs=self.num_seqs, batch_invariant=config.batch_invariant,
                  speculative_config=config.speculative_config, compile_decode=config.compile_decode,
                  compile_gemms=config.compile_gemms)
        if not self.prompts:
            self._describe(llm.engine)
        for name, workload in self.workloads.items():
            run_kvserve(llm, self.prompts[name][:2], 4)  # warm-up
            _reset(llm)  # every timed run prefills its prompts in full, as the other engines do
            self.batched[name].append(_maybe_profiled(self.args.profile, self.console, name, run_kvserve, llm,
                                                      self.prompts[name], workload.output_len, config.name))
        if "single" not in self.args.skip:
            first = next(iter(self.workloads))
            _reset(llm)
            self.singles.append(_maybe_profiled(self.args.profile, self.console, "single stream", run_kvserve_serial,
                                                llm, self.single_prompts(), self.workloads[first].output_len,
                                                config.name))
            if self.paired_llama_cpp:
                single, output_len = self.single_prompts(), self.workloads[first].output_len
                self.paired.append(run_llama_cpp(single, output_len, max(map(len, single)) + output_len,
                                                 "llama.cpp"))
        del llm
        gc.collect()

    def llama_cpp_median(self) -> RunResult | str:
        """llama.cpp's single-stream row: the median of its paired runs (the first reason, if none ran)."""
        ran = [r for r in self.paired if isinstance(r, RunResult)]
        if not ran:
            return self.paired[0]
        median = _median(ran)
        return median if len(ran) == 1 else replace(median, name=f"llama.cpp (median of {len(ran)} runs)")

    def keep_medians(self, num_configs: int) -> dict[str, list[list[RunResult]]]:
        """After several rounds (each config in turn, round after round): keep each config's median run (by tokens/s)
        as its row, and return every workload's runs per config, round by round (for _print_rounds)."""
        rounds = {}
        for name, rows in [*self.batched.items(), ("single stream", self.singles)]:
            per_config = [rows[i::num_configs] for i in range(num_configs)]
            rounds[name] = per_config
            rows[:] = [_median(runs) for runs in per_config if runs]
        return rounds

    def single_prompts(self) -> list[list[int]]:
        """The single stream's prompts: the first workload's first; every document of the rewrite workload."""
        first = next(iter(self.workloads))
        return self.prompts[first] if first == "rewrite" else self.prompts[first][:1]

    def _describe(self, engine) -> None:
        self.model_path, self.model_config = engine.model_path, engine.model_config
        tokenizer = engine.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        for name, workload in self.workloads.items():
            self.prompts[name] = workload.prompts(engine.model_config.vocab_size, tokenizer)
            self.console.print(workload.describe(self.prompts[name]))


def _print_rounds(console, per_config: list[list[RunResult]]) -> None:
    """With --repeat: each configuration's tokens/s over the first one's, round by round, and the median."""
    if not per_config or len(per_config[0]) < 2:
        return
    console.print(f"kvserve rows: median of {len(per_config[0])} interleaved runs; tokens/s ÷ {per_config[0][0].name} "
                  "in each round (median):")
    for runs in per_config[1:]:
        ratios = [r.tokens_per_s / first.tokens_per_s for r, first in zip(runs, per_config[0])]
        console.print(f"  {runs[0].name}: {', '.join(f'{x:.2f}x' for x in ratios)} "
                      f"({statistics.median(ratios):.2f}x)")


def _median(runs: list[RunResult]) -> RunResult:
    """The run of median tokens/s (the lower middle one of an even number)."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]


def _print_transformers_rounds(console, per_config: list[list[RunResult]], hf_runs: list[RunResult]) -> None:
    """With --repeat: each kvserve row over the transformers run of its own round, round by round, and the median
    (transformers' row is the median of its rounds)."""
    if len(hf_runs) < 2:
        return
    _print_ratios(console, f"transformers: median of {len(hf_runs)} runs, one at the end of each round; kvserve "
                  "tokens/s ÷ transformers in the same round (median):", per_config, [hf_runs] * len(per_config))


def _print_llama_cpp_pairs(console, per_config: list[list[RunResult]], paired: list[RunResult | str]) -> None:
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


def _report_workload(console, args, workload: Workload, rows, num_kvserve: int, model_config, with_hf: bool) -> None:
    _print_table(console, f"Batched throughput, {workload.name} (output tokens/s)", rows)
    if with_hf and workload.name != "long-context":
        console.print(f"transformers: float32, generate() on left-padded static batches of {args.hf_batch_size}")
        reference = next(r for r in rows if isinstance(r, RunResult) and r.name == "transformers")
        for r in rows[:num_kvserve]:
            console.print(f"{r.name}: greedy output identical to transformers for {agreement(r, reference):.0%} "
                          "of requests")
    _print_compiled_steps(console, rows[:num_kvserve])
    if any(isinstance(r, RunResult) and r.name.startswith("llama.cpp") for r in rows):
        console.print("llama.cpp: llama-cpp-python on the Q4_1 GGUF; serial: one request after another; "
                      "batched: all requests in one llama_decode per step (its batch API)")
    if "roofline" not in args.skip:
        _print_roofline(console, rows[:num_kvserve], model_config)
        _print_decode_split(console, rows[:num_kvserve], model_config)


def _print_compiled_steps(console, rows: list[RunResult | str]) -> None:
    """--compile-decode rows: how many of their decode-only steps, and of their steps with prompt tokens, ran a
    compiled graph; the others ran eagerly, as in the eager row (compile/steps.py says which steps the graphs
    cover)."""
    for r in rows:
        if isinstance(r, RunResult) and "compiled decode" in r.name:
            console.print(f"{r.name}: compiled graphs ran {r.compiled_steps:,} of its {r.decode_steps:,} decode-only "
                          f"steps and {r.compiled_prefill_steps:,} of its {r.prefill_steps:,} steps with prompt tokens")


def _print_speculation(console, rows: list[RunResult | str]) -> None:
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


def _print_roofline(console, runs: list[RunResult], model_config) -> None:
    """Each row's matmul FLOP/s over the replayed rate, and two ceilings on that share (roofline.share_ceiling): its
    decode-only steps at their replayed matmuls plus one read of their K/V at the CPU's read bandwidth, its steps
    with prompt tokens at their replayed matmuls too (prefill's attention left out), or as long as they took."""
    from kvserve.bench.roofline import (MatmulShapes, decode_steps, read_bandwidth, replay_matmul, replayed_seconds,
                                        share_ceiling, step_seconds, workload_flops)

    shapes = MatmulShapes.of(model_config)
    reference = runs[0]
    per_step = step_seconds(shapes, reference.steps)
    flops = workload_flops(shapes, reference.steps)
    roof = flops / replayed_seconds(per_step, reference.steps)
    decodes = decode_steps(reference.steps)  # their own rate: fewer tokens a step than a prompt's
    decode_roof = workload_flops(shapes, decodes) / replayed_seconds(per_step, decodes) if decodes else roof
    bandwidth = read_bandwidth()
    console.print(f"roofline: this workload's matmuls (linears and output head; attention not counted) are "
                  f"{flops / 1e9:,.0f} GFLOP; float32 matmuls of the same shapes ({replay_matmul().name}, as the "
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


def _print_decode_split(console, runs: list[RunResult | str], model_config) -> None:
    """Each kvserve row's decode-only time per token, split into what its matmuls alone take (replayed now: plain
    float32, every layer's own weights, the first row's decode steps) and the rest (attention, norms, RoPE, the
    step's Python). Two bounds beside it: those matmuls plus the row's K/V read once at the CPU's read bandwidth,
    the least a token takes with the engine's matmul route; and the float32 weights read once a step at that
    bandwidth, the least any matmul kernel needs."""
    from kvserve.bench.roofline import MatmulShapes, decode_steps, matmul_seconds, read_bandwidth, replay_matmul
    from kvserve.model.float_kernels import BLAS
    from kvserve.model.int8_kernels import FloatKernel

    ran = [r for r in runs if isinstance(r, RunResult) and r.decode_tokens and r.routes is not None]
    if not ran:
        return
    steps = decode_steps(ran[0].steps)
    tokens = sum(rows * count for (_, rows), count in steps.items())
    if not tokens:
        return
    matmul_ms = matmul_seconds(MatmulShapes.of(model_config), steps) / tokens * 1e3
    replayed = replay_matmul()
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
        routes = run.routes
        int8_kernel = routes.int8_kernel
        int8_own = int8_kernel is not None and not isinstance(int8_kernel, FloatKernel)
        matmul = routes.float_matmul  # int8 weights: F.linear, as their codes are multiplied as float32 (FloatKernel)
        if routes.gemms:  # the template, over float weights or oneDNN's int8 ones (compile/steps.py, gemms_unused)
            own = f"Inductor's GEMM template, not the replayed {replayed.name}"
        elif int8_own:
            own = f"{int8_kernel.name}'s int8 ones"
        elif matmul is not replayed:  # float weights by another route (or int8 codes as float32 by F.linear)
            own = f"{matmul.name}'s, not the replayed {replayed.name}"
        elif single and routes.one_row_loops:
            # float weights (float32, bfloat16), one row in the graph: model/linear.py, one_row_in_graph
            own = f"Inductor's matrix-vector loops over every core, not the replayed {replayed.name}'s calls"
        else:  # the replayed calls (float32 weights, or int8 codes multiplied as float32)
            own = None
        if own is not None:  # no split
            console.print(f"  {run.name}: {total_ms:.1f} ms, {total_ms / matmul_ms:.2f}x the replayed matmuls alone "
                          f"(no split: its matmuls are {own})")
            continue
        kv_ms = run.decode_kv_bytes / run.decode_tokens / bandwidth * 1e3
        least = (f"; least {matmul_ms + kv_ms:.1f} ms with its K/V read once ({kv_ms:.1f} ms), "
                 f"{(matmul_ms + kv_ms) / total_ms:.0%} of its time") if run.decode_kv_bytes else ""
        console.print(f"  {run.name}: {total_ms:.1f} ms = matmuls {matmul_ms:.1f} + the rest "
                      f"{total_ms - matmul_ms:.1f} (attention, norms, RoPE, Python){least}")


def _cpu_name() -> str:
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


def _speeds(results: list[RunResult | str]) -> dict[str, float]:
    """Tokens/s of the engines that ran (a str is one that could not)."""
    return {r.name: r.tokens_per_s for r in results if isinstance(r, RunResult)}


def _llama_cpp_ready(console) -> bool:
    from kvserve.bench.llama_cpp_baseline import NOT_INSTALLED, llama_cpp_installed

    if llama_cpp_installed():
        return True
    console.print(f"llama.cpp: {NOT_INSTALLED}", markup=False)  # as markup, '[bench]' would vanish
    return False


def _maybe_profiled(profile: bool, console, label: str, fn, *args):
    if not profile:
        return fn(*args)
    import cProfile
    import pstats
    import resource

    profiler = cProfile.Profile()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    result = profiler.runcall(fn, *args)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    stats = pstats.Stats(profiler).sort_stats("tottime")
    total = sum(row[2] for row in stats.stats.values())  # tottime summed over all functions
    # each minor fault is a page the OS had to map and zero (freed memory handed back and taken again)
    console.print(f"{result.name}, {label}: {faults:,} minor page faults; share of time by function (cProfile "
                  "tottime)")
    for (file, line, name), row in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]:
        console.print(f"  {row[2] / total:6.1%}  {name}  ({file.rsplit('/', 1)[-1]}:{line})")
    return result


def _print_table(console, title: str, results: list[RunResult | str]) -> None:
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
        table.add_row(r.name, f"{r.output_tokens:,}", f"{r.seconds:.1f}", f"{r.tokens_per_s:.1f}", *ratios,
                      f"{decode:.1f}" if decode else "-", decode_ratio)
    console.print(table)
