"""`kvserve bench startup`: what the default compiled decode steps add to an engine's start over `--enforce-eager`,
first on an empty compile cache and then cached, each start timed beside an eager one.

A start is a process of its own running `kvserve generate PROMPT --max-tokens 4`, timed from launch to exit, as a
user sees it (Python and torch imports, weights, the compile, the first tokens). For each quantization, in a new
Inductor cache directory (TORCHINDUCTOR_CACHE_DIR) of its own: an eager start, the first compiled start (empty cache),
then --rounds pairs of an eager and a cached compiled start, one right after the other. This machine's speed drifts
by tens of percent over tens of seconds (docs/benchmarks.md), so the cached start's overhead is each pair's
difference and their median, not a difference of two medians taken minutes apart; the first start is compared
with the eager start run just before it. The compile's own time, from the start-up line ("decode steps: ... in
X s"), is printed beside it."""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from kvserve.config import EAGER_STEPS_VARIABLE

PROMPT = "Hello"
FIRST_START_GOAL_S = 60.0  # issue 29: the first compiled start at most this much over an eager one
CACHED_START_GOAL_S = 3.0  # issue 62: a cached one at most this much
COMPILED_LINE = re.compile(r"decode steps: (.*?), in ([\d.]+) s(?: \(([^)]*)\))?")


@dataclass
class Start:
    seconds: float  # launch to exit
    compile_seconds: float | None  # from the start-up line; None: no graph compiled (eager, or it fell back)
    phases: str = ""  # where the compile went, as the start-up line says (torch.compile's own timers)


def add_startup_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("startup", help="start-up time: eager, compiled on an empty cache, cached")
    p.add_argument("--model", default=None, help="as `kvserve generate --model` (default: the embedded model)")
    p.add_argument("--quantization", nargs="+", choices=["none", "int8"], default=["none", "int8"],
                   help="weights (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="eager and cached starts, side by side (default 3)")
    p.set_defaults(func=run_startup)


def start_command(model: str | None, quantization: str, compiled: bool) -> list[str]:
    """The process a start runs: `kvserve generate` of a few tokens, with the default (compiled) steps or
    --enforce-eager."""
    return [sys.executable, "-m", "kvserve", "generate", PROMPT, "--max-tokens", "4", "--quantization", quantization,
            *(["--model", model] if model else []), *([] if compiled else ["--enforce-eager"])]


def run_start(command: list[str], cache_dir: str) -> Start:
    """One start, timed; raises if it failed (its error's last lines)."""
    begun = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != EAGER_STEPS_VARIABLE}  # the user's default, not a suite's
    done = subprocess.run(command, env={**env, "TORCHINDUCTOR_CACHE_DIR": cache_dir}, capture_output=True, text=True)
    seconds = time.perf_counter() - begun
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:])} exited with {done.returncode}: {done.stderr[-1500:]}")
    found = COMPILED_LINE.search(done.stderr)
    compiled = found is not None and "compiled" in found.group(1)
    return Start(seconds, float(found.group(2)) if compiled else None, (found.group(3) or "") if compiled else "")


def measure(model: str | None, quantization: str, rounds: int) -> dict[str, list[Start]]:
    """The starts of one quantization, in the order run: eager, first compiled, then `rounds` pairs."""
    starts: dict[str, list[Start]] = {"eager": [], "first": [], "cached": []}
    eager, compiled = (start_command(model, quantization, c) for c in (False, True))
    with tempfile.TemporaryDirectory(prefix="kvserve-startup-") as cache_dir:
        starts["eager"].append(run_start(eager, cache_dir))
        starts["first"].append(run_start(compiled, cache_dir))
        for _ in range(rounds):
            starts["eager"].append(run_start(eager, cache_dir))
            starts["cached"].append(run_start(compiled, cache_dir))
    for start in starts["first"] + starts["cached"]:
        if start.compile_seconds is None:
            raise RuntimeError(f"--quantization {quantization}: the default start compiled no decode graph (run "
                               f"`{' '.join(compiled[2:])}` to see its start-up line)")
    return starts


def report(quantization: str, starts: dict[str, list[Start]]) -> list[str]:
    eager = [s.seconds for s in starts["eager"]]
    first = starts["first"][0]
    first_over = first.seconds - eager[0]
    pairs = [c.seconds - e for c, e in zip(starts["cached"], eager[1:])]
    cached_over = statistics.median(pairs)
    cached_compile = statistics.median(s.compile_seconds for s in starts["cached"])
    last_phases = starts["cached"][-1].phases
    return [
        f"--quantization {quantization}:",
        f"  eager start: {statistics.median(eager):.1f} s (median of {len(eager)}: "
        f"{', '.join(f'{s:.1f}' for s in eager)})",
        f"  first compiled start (empty cache): {first.seconds:.1f} s, +{first_over:.1f} s over the eager start "
        f"before it (compile {first.compile_seconds:.1f} s); goal under +{FIRST_START_GOAL_S:.0f} s: "
        f"{'met' if first_over < FIRST_START_GOAL_S else 'NOT met'}",
        f"  cached compiled start: {statistics.median(s.seconds for s in starts['cached']):.1f} s, "
        f"+{cached_over:.1f} s over the eager start beside it (each pair: "
        f"{', '.join(f'{p:+.1f}' for p in pairs)}; compile {cached_compile:.1f} s"
        f"{f', the last: {last_phases}' if last_phases else ''}); goal at most "
        f"+{CACHED_START_GOAL_S:.0f} s: {'met' if cached_over <= CACHED_START_GOAL_S else 'NOT met'}",
    ]


def run_startup(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    print(f"start-up, `kvserve generate {PROMPT} --max-tokens 4` launch to exit, --enforce-eager and the default; each "
          "quantization in a new compile cache")
    for quantization in args.quantization:
        try:
            starts = measure(args.model, quantization, args.rounds)
        except RuntimeError as exc:  # a start that failed or compiled nothing: its own error, no traceback
            raise SystemExit(f"kvserve bench startup: {exc}") from exc
        for line in report(quantization, starts):
            print(line, flush=True)
    return 0
