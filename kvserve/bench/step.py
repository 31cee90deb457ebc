"""`kvserve bench step`: one decode step timed three ways in one process: eager, the whole compiled graph
(attention inside it) and the graph with attention outside it (compile/steps.py), for batches of a few
sizes whose context lengths are alike (one attention call per layer group) or spread (several). An engine whose KV
format attends with a decode kernel of its own (int8, int4, nuq) compiles no whole graph: its steps are timed eager
and with attention outside, a single stream's too.

Under each batch of several, what its attention takes in the graph with attention outside it: that graph's step
less the same graph with an attention op that returns zeros (replayed alike, interleaved), and the K/V bytes its
sequences' contexts hold, read once, over that time, beside what this CPU reads summing 1 GiB of float32 with every
core (bench/roofline.py, read_bandwidth): how far attention's kernel is from reading its K/V at memory speed.

For each batch, --sequences requests of random prompts (fixed seed) are prefilled and decoded a few steps on one
engine; one of their decode steps is captured (its tokens and metadata) and replayed --repeat times by each
runner in turn, so a slow spell weighs on all alike, and the medians are printed with their ratio to eager. The
replays write the same K/V to the same slots each time. Both graphs are the ones the engine compiled (or loaded) at
start; "serving runs" says which of them serving gives the step (several sequences run the whole graph while their
padded K/V is small: compile/steps.py, WHOLE_GRAPH_KV_BYTES)."""
from __future__ import annotations

import argparse
import statistics
import time

ALIKE_LENGTH = 300  # prompt tokens of the first sequence of an alike batch; the others one token more each
SPREAD_LENGTHS = (64, 512)  # the decode-heavy workload's range: a spread batch runs from one to the other


def add_step_parser(bench_subparsers) -> None:
    from kvserve.engine.cli import add_engine_args

    p = bench_subparsers.add_parser("step", help="one decode step: eager, the whole graph, attention outside it")
    add_engine_args(p)
    p.add_argument("--sequences", type=int, nargs="+", default=[1, 2, 4, 16], metavar="N",
                   help="batch sizes (default: %(default)s)")
    p.add_argument("--contexts", nargs="+", choices=["alike", "spread"], default=["alike", "spread"],
                   help="the batch's context lengths (default: both; one sequence is always alike)")
    p.add_argument("--repeat", type=int, default=25, help="replays per runner (default %(default)s)")
    p.set_defaults(func=run_step, compile_decode=True, max_model_len=SPREAD_LENGTHS[1] + 64)


def run_step(args: argparse.Namespace) -> int:
    import dataclasses

    from kvserve.engine.cli import engine_config_from_args
    from kvserve.engine.llm import LLM
    from kvserve.engine.python_stack import with_stack_headroom

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    engine = llm.engine
    compiled = engine.runner.compiled
    if compiled is None:
        raise SystemExit("this engine compiles no decode graph (its start-up line says why)")
    if not compiled.whole:  # a KV format with a decode kernel of its own (int8, int4, nuq): attention outside only
        print("this engine compiles no whole decode graph (its start-up line says why): eager and attention outside "
              "only")
    from kvserve.bench.roofline import read_bandwidth
    from kvserve.compile.steps import zero_attention

    bandwidth = read_bandwidth()
    print(f"one decode step, ms: median of {args.repeat} replays, interleaved (÷ eager)")
    cases = [(n, kind) for n in args.sequences for kind in (["alike"] if n == 1 else args.contexts)]
    for n, kind in cases:
        input_ids, meta = _decode_step(engine, n, kind)
        runners = {"eager": lambda: _eager(engine, input_ids, meta)}
        if compiled.whole and compiled.eligible(meta):
            runners["whole graph"] = lambda: compiled.run_whole(input_ids, meta, compile_missing=True)
        if compiled.fits_outside(input_ids, meta):  # one sequence only where no whole graph takes it
            runners["attention outside"] = lambda: compiled.run_outside(input_ids, meta)
            runners[NO_ATTENTION] = lambda: compiled.run_outside(input_ids, meta, zero_attention)
        for run in runners.values():  # a first call compiles what no graph compiled at start fits, if any
            _begin_replay(engine, meta)
            with_stack_headroom(run)
        times = {name: [] for name in runners}
        for _ in range(args.repeat):
            for name, run in runners.items():
                # the step's own slots for each runner (--compile-gemms' whole graph sets two rows' for one sequence)
                _begin_replay(engine, meta)
                begun = time.perf_counter()
                with_stack_headroom(run)  # as the engine runs a step (engine/python_stack.py)
                times[name].append(time.perf_counter() - begun)
        medians = {name: statistics.median(t) for name, t in times.items()}
        bare = medians.pop(NO_ATTENTION, None)
        cells = ", ".join(f"{name} {m * 1e3:.2f}" + ("" if name == "eager" else f" ({medians['eager'] / m:.2f}x)")
                          for name, m in medians.items())
        calls = max(len(groups) for groups in meta.groups)
        # --compile-gemms: the frozen whole graph runs every step it takes, several alike sequences too
        served = "whole graph" if "whole graph" in runners and compiled.whole_reads_less(input_ids, meta) else \
            "attention outside"
        print(f"{n} sequence{'s' if n > 1 else ''}, {kind} contexts ({calls} attention call"
              f"{'s' if calls > 1 else ''} per layer group): {cells}; serving runs: {served}")
        if bare is not None:
            attention = medians["attention outside"] - bare
            kv_bytes = int((meta.positions + 1).sum()) * engine.cache_plan.kv_bytes_per_token
            rate = f"{kv_bytes / attention / 1e9:.1f} GB/s" if attention > 0 else "no time measured"
            print(f"  its attention, outside the graph: {attention * 1e3:.2f} ms (the graph with attention returning "
                  f"zeros {bare * 1e3:.2f}), {kv_bytes / 1e6:,.1f} MB of K/V read once: {rate}; this CPU reads "
                  f"{bandwidth / 1e9:.1f} GB/s")
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
    print("whole graph: attention inside it (it takes one call per layer group only); attention outside: "
          "the rest in the graph, attention eager, call by call")
    return 0


def _decode_step(engine, num_seqs: int, kind: str):
    """The tokens and metadata of a decode step of `num_seqs` fresh requests, after their prefill."""
    import torch

    from kvserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(num_seqs)
    low, high = SPREAD_LENGTHS
    lengths = [ALIKE_LENGTH + i if kind == "alike" else low + (high - low) * i // max(num_seqs - 1, 1)
               for i in range(num_seqs)]
    vocab = engine.model_config.vocab_size
    for i, length in enumerate(lengths):
        prompt = torch.randint(100, vocab - 100, (length,), generator=g).tolist()
        engine.add_request(f"step-{num_seqs}-{kind}-{i}", prompt,
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    captured = []
    build = engine.runner.build_batch

    def capturing(out):
        input_ids, meta, chunks = build(out)
        if len(chunks) == num_seqs and all(c.num_tokens == 1 for c in chunks):
            captured.append((input_ids, meta))
        return input_ids, meta, chunks

    engine.runner.build_batch = capturing
    try:
        while len(captured) < 2:  # the second decode step: every sequence is past its prefill
            engine.step()
    finally:
        engine.runner.build_batch = build
    return captured[-1]


NO_ATTENTION = "attention as zeros"  # the graph with attention outside, its op returning zeros: attention's share


def _begin_replay(engine, meta) -> None:
    """The captured step's slots, as its run began them, with what the previous run filled kept (int4 and nuq quantize
    a block when a step fills it, from staged tokens that step's end gives back)."""
    engine.cache.rewind_step()
    engine.cache.begin_step([], [], meta.slot_mappings)


def _eager(engine, input_ids, meta):
    return engine.model.forward(input_ids, meta, engine.cache)
