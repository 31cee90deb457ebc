"""The engines `kvserve bench throughput` times, one runner each: kvserve (stepped, to time its decode-only steps and
record every step's shape), transformers (`generate` on padded static batches) and llama.cpp (in a child process).
KvserveRuns and TransformersRuns hold the runs of every round, so that each baseline runs beside the kvserve runs it
is compared with."""
from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from kvserve.bench.throughput.configs import KvserveConfig
from kvserve.bench.throughput.constrained import ConstrainedMix
from kvserve.bench.throughput.results import Routes, RunResult, median_run
from kvserve.bench.throughput.workloads import Workload

if TYPE_CHECKING:
    import torch

LOOKUP_ROOM = 16  # context llama-cpp-python's prompt lookup needs past the last token (its 10 drafts and 1)


def run_kvserve(llm, prompts: list[list[int]], output_len: int, name: str = "kvserve",
                structured: list | None = None) -> RunResult:
    """All prompts at once, stepping the engine to time decode-only steps and record each step's shape;
    `structured`: each prompt's constraint (StructuredOutputsParams, or None), for the constrained mix."""
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    constraints = structured or [None] * len(prompts)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    lengths = dict.fromkeys(ids, 0)
    outputs: dict[str, list[int]] = {}
    steps: Counter = Counter()
    decode_tokens, decode_seconds, decode_steps, decode_keys, prefill_seconds = 0, 0.0, 0, 0, 0.0
    compiled = {True: 0, False: 0}  # steps that ran a compiled graph, by whether they prefilled
    prompt_lens = {request_id: len(prompt) for request_id, prompt in zip(ids, prompts)}
    prefill_start = engine.num_prefill_tokens
    spec_start = _spec_counts(engine)
    start = time.perf_counter()
    for request_id, prompt, constraint in zip(ids, prompts, constraints):
        engine.add_request(request_id, prompt, replace(params, structured_outputs=constraint))
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
        prefill_seconds += step_seconds if prefilled else 0.0
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
                     sum(steps.values()) - decode_steps, compiled[True], prefill_seconds)


def run_kvserve_serial(llm, prompts: list[list[int]], output_len: int, name: str = "kvserve") -> RunResult:
    """One request after another (a single stream over several prompts), summed."""
    runs = [run_kvserve(llm, [prompt], output_len, name) for prompt in prompts]
    total = lambda field_name: sum(getattr(r, field_name) for r in runs)  # noqa: E731
    return RunResult(name, total("output_tokens"), total("seconds"), [r.outputs[0] for r in runs],
                     total("decode_tokens"), total("decode_seconds"), sum((r.steps for r in runs), Counter()),
                     total("prefill_tokens"), total("draft_tokens"), total("accepted_tokens"), total("drafts"),
                     total("decode_steps"), total("compiled_steps"), total("decode_kv_bytes"), runs[0].routes,
                     total("prefill_steps"), total("compiled_prefill_steps"), total("prefill_seconds"))


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
                     use_cache: bool = True, name: str = "transformers", phases: bool = False) -> RunResult:
    """generate() on left-padded static batches; with `phases`, each batch's time up to its first logits (the
    prefill, timed by a logits processor in the same run) apart from the rest (decode)."""
    import torch

    outputs, start, prefill_seconds = [], time.perf_counter(), 0.0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding, as generate wants
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        stamps, batch_start = [], time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, use_cache=use_cache, pad_token_id=pad_id,
                                 logits_processor=_timestamps(stamps) if phases else None)
        outputs.extend(out[:, width:].tolist())
        prefill_seconds += stamps[0] - batch_start if stamps else 0.0
    seconds = time.perf_counter() - start
    result = RunResult(name, sum(map(len, outputs)), seconds, outputs)
    if not phases:
        return result
    return replace(result, decode_tokens=result.output_tokens - len(prompts), decode_seconds=seconds - prefill_seconds,
                   prefill_tokens=sum(map(len, prompts)), prefill_seconds=prefill_seconds)


def _timestamps(stamps: list[float]):
    """A logits processor list that appends the time of each call (after each forward pass) to `stamps`."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    return LogitsProcessorList([Stamp()])


def load_transformers(path, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_llama_cpp(prompts: list[list[int]], output_len: int, n_ctx: int, name: str,
                  batched: bool = False, lookup: bool = False) -> RunResult | str:
    """A RunResult, or the reason llama.cpp could not run here. `lookup`: serial, with its prompt lookup decoding."""
    import torch

    from kvserve.bench.llama_cpp_baseline import run_in_child

    result = run_in_child(prompts, output_len, n_ctx, torch.get_num_threads(), batched, lookup)
    if "error" in result:
        return result["error"]
    return RunResult(name, sum(map(len, result["outputs"])), result["seconds"], result["outputs"])


def run_llama_cpp_lookup(prompts: list[list[int]], output_len: int) -> RunResult | str:
    """llama.cpp's own speculation, serial: its draft's logits need room past the last token (LOOKUP_ROOM)."""
    n_ctx = max(map(len, prompts)) + output_len + LOOKUP_ROOM
    return run_llama_cpp(prompts, output_len, n_ctx, "llama.cpp + prompt lookup", lookup=True)


def llama_cpp_ready(console) -> bool:
    from kvserve.bench.llama_cpp_baseline import NOT_INSTALLED, llama_cpp_installed

    if llama_cpp_installed():
        return True
    console.print(f"llama.cpp: {NOT_INSTALLED}", markup=False)  # as markup, '[bench]' would vanish
    return False


def maybe_profiled(profile: bool, console, label: str, fn, *args):
    """fn(*args), and with `profile` its minor page faults and the functions it spent its time in, printed."""
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


class KvserveRuns:
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
        share = getattr(args, "constrained_share", 0.0)
        self.constrained = ConstrainedMix(share) if share > 0 and "decode" in workloads else None

    def run(self, config: KvserveConfig) -> None:
        from kvserve.engine.llm import LLM

        llm = LLM(self.args.model, dtype=config.dtype, quantization=config.quantization,
                  kv_cache_dtype=config.kv_cache_dtype, block_size=config.block_size, max_model_len=self.max_len,
                  kv_cache_memory=self.kv_memory,
                  max_num_seqs=self.num_seqs, batch_invariant=config.batch_invariant,
                  speculative_config=config.speculative_config, compile_decode=config.compile_decode,
                  compile_gemms=config.compile_gemms, **config.eviction)
        if not self.prompts:
            self._describe(llm.engine)
        states = llm.engine.runner.state_cache
        config_name = config.ran_as(llm.engine.runner.compiled is not None,
                                    states is not None and states.update_kind() == "compiled")
        for name, workload in self.workloads.items():
            run_kvserve(llm, self.prompts[name][:2], 4)  # warm-up
            _reset(llm)  # every timed run prefills its prompts in full, as the other engines do
            self.batched[name].append(maybe_profiled(self.args.profile, self.console, name, run_kvserve, llm,
                                                     self.prompts[name], workload.output_len, config_name))
            if name == "decode" and self.constrained is not None:
                self.constrained.run(llm, self.prompts[name], workload.output_len, config_name, run_kvserve, _reset)
        if "single" not in self.args.skip:
            self._run_single_stream(llm, config_name)
        del llm
        gc.collect()

    def _run_single_stream(self, llm, config_name: str) -> None:
        """The single stream, and with `paired_llama_cpp` llama.cpp's right after it."""
        first = next(iter(self.workloads))
        _reset(llm)
        self.singles.append(maybe_profiled(self.args.profile, self.console, "single stream", run_kvserve_serial,
                                           llm, self.single_prompts(), self.workloads[first].output_len,
                                           config_name))
        if self.paired_llama_cpp:
            single, output_len = self.single_prompts(), self.workloads[first].output_len
            self.paired.append(run_llama_cpp(single, output_len, max(map(len, single)) + output_len, "llama.cpp"))

    def llama_cpp_median(self) -> RunResult | str:
        """llama.cpp's single-stream row: the median of its paired runs (the first reason, if none ran)."""
        ran = [r for r in self.paired if isinstance(r, RunResult)]
        if not ran:
            return self.paired[0]
        median = median_run(ran)
        return median if len(ran) == 1 else replace(median, name=f"llama.cpp (median of {len(ran)} runs)")

    def keep_medians(self, num_configs: int) -> dict[str, list[list[RunResult]]]:
        """After several rounds (each config in turn, round after round): keep each config's median run (by tokens/s)
        as its row, and return every workload's runs per config, round by round (for report.print_rounds)."""
        rounds = {}
        for name, rows in [*self.batched.items(), ("single stream", self.singles)]:
            per_config = [rows[i::num_configs] for i in range(num_configs)]
            rounds[name] = per_config
            rows[:] = [median_run(runs) for runs in per_config if runs]
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


class TransformersRuns:
    """transformers' batched runs, one per workload at the end of each round, beside that round's kvserve runs: the
    machine's speed drifts over minutes, and a ratio over one transformers run made after every round carried it.
    Long-context runs kvserve only; with no workload left, transformers does not run (`model` stays None). With
    `phases`, each run also times its prefill apart (run_transformers)."""

    def __init__(self, workloads: dict[str, Workload], phases: bool = False, dtype: str = "float32"):
        self.workloads = {name: w for name, w in workloads.items() if name != "long-context"}
        self.dtype = dtype  # transformers' weights (--hf-dtype)
        self.rounds: dict[str, list[RunResult]] = {name: [] for name in self.workloads}
        self.model = None
        self.pad_id = 0
        self.phases = phases

    def run_round(self, kvserve: KvserveRuns, batch_size: int) -> None:
        """Each workload's batched run on kvserve's prompts (the model loaded and warmed up the first time)."""
        if not self.rounds:
            return
        if self.model is None:
            import torch

            self.model, self.pad_id = load_transformers(kvserve.model_path, getattr(torch, self.dtype)), kvserve.pad_id
            run_transformers(self.model, kvserve.prompts[next(iter(self.rounds))][:2], 4, 2, self.pad_id)  # warm-up
        for name, runs in self.rounds.items():
            runs.append(run_transformers(self.model, kvserve.prompts[name], self.workloads[name].output_len,
                                         batch_size, self.pad_id, phases=self.phases))

    def single_stream(self, prompts: list[list[int]], output_len: int) -> list[RunResult]:
        """One request at a time, with its KV cache and without."""
        return [run_transformers(self.model, prompts, output_len, 1, self.pad_id, phases=self.phases),
                run_transformers(self.model, prompts, output_len, 1, self.pad_id, False, "transformers, no KV cache")]
