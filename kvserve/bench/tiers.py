"""`kvserve bench multiturn --tiers`: many conversations on a pool that holds a few of them, three ways: the pool
alone ("pool only": prefix caching, no tier), the pool with a disk tier (--kv-disk-cache), and the disk tier with
an engine restart after turn --restart-after.

Turns go round-robin: turn 1 of every conversation, then turn 2 of every conversation, and so on, so between two
turns of one conversation all the others run and the pool's LRU has evicted it (the pool is sized to hold about
--pool-share of all conversations). Each turn sends the whole history plus a new question, as a stateless chat API
does. For each way it prints the prompt tokens computed (against the new input tokens: first prompts and
questions), the share of returning turns' prompts found cached, their time to first token (p50, p99, and p50 of
those with at least 2,000 tokens of history), the bytes the tier read and wrote, and its read rate (reading,
checking and decoding records) against a plain sequential read of a file in the same directory, in the same run.
Before the restart the records' pages are dropped from the page cache (posix_fadvise DONTNEED), so the restarted
engine reads from the disk, not from memory. `--plot` draws each way's TTFT per returning turn against its history
and its prompt tokens computed against the new input.

`kvserve bench multiturn` adds these options to its own (`add_tier_arguments`) and hands a --tiers run here
(`run_tiers_from_args`)."""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench.conversation import Conversation
from kvserve.plots import check_plot_path, plot_tiers
from kvserve.sampling_params import SamplingParams

LONG_HISTORY_TOKENS = 2000
SEQUENTIAL_FILE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class TierWorkload:
    conversations: int = 8
    turns: int = 6
    first_tokens: int = 1200
    question_tokens: int = 200
    answer_tokens: int = 16
    restart_after: int = 4
    pool_share: float = 0.15
    seed: int = 0

    @property
    def max_len_tokens(self) -> int:
        return Conversation(self.first_tokens, self.question_tokens, self.answer_tokens, self.turns).max_len_tokens

    def questions(self, vocab_size: int) -> list[list[list[int]]]:
        """Per conversation, its first prompt and later questions (each conversation its own random ids)."""
        return [Conversation(self.first_tokens, self.question_tokens, self.answer_tokens, self.turns,
                             self.seed + c).questions(vocab_size) for c in range(self.conversations)]


@dataclass
class ReturningTurn:
    history_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class TierRun:
    name: str
    prefilled_tokens: int = 0
    new_tokens: int = 0
    returning: list[ReturningTurn] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    bytes_read: int = 0
    queued_reads: int = 0  # blocks found still queued for the disk writer, taken from memory
    bytes_written: int = 0
    read_s: float = 0.0

    def add_disk_stats(self, stats: dict) -> None:
        if "disk_cache_bytes_read" in stats:
            self.bytes_read += stats["disk_cache_bytes_read"]
            self.queued_reads += stats["disk_cache_queued_reads"]
            self.bytes_written += stats["disk_cache_bytes_written"]
            self.read_s += stats["disk_cache_read_seconds"]


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The --tiers options, a group of `kvserve bench multiturn`'s parser (which also gives the shape: --first,
    --question, --answer, --turns, --seed, --model, --plot)."""
    w = TierWorkload()
    tiers = parser.add_argument_group("tiers", "--tiers: many conversations round-robin on a small pool, without "
                                      "and with a disk tier, and with a restart (kvserve/bench/tiers.py)")
    tiers.add_argument("--tiers", action="store_true", help="run the tier comparison instead of one conversation")
    tiers.add_argument("--conversations", type=int, default=w.conversations)
    tiers.add_argument("--restart-after", type=int, default=w.restart_after,
                       help="the restarted run's engine restarts after this turn (default %(default)s)")
    tiers.add_argument("--pool-share", type=float, default=w.pool_share,
                       help="the pool holds this share of all conversations' tokens (default %(default)s)")
    tiers.add_argument("--kv-cache-dtype", default="auto")
    tiers.add_argument("--kv-disk-cache", default=None, metavar="DIR",
                       help="where the tier runs keep their records (default: a temporary directory, removed after)")


def run_tiers_from_args(args: argparse.Namespace) -> int:
    if not 1 <= args.restart_after < args.turns or args.conversations < 1 or not 0 < args.pool_share <= 1:
        raise SystemExit("kvserve bench multiturn --tiers: needs 1 <= --restart-after < --turns, --conversations >= "
                         "1 and 0 < --pool-share <= 1")
    workload = TierWorkload(args.conversations, args.turns, args.first, args.question, args.answer,
                            args.restart_after, args.pool_share, args.seed)
    try:
        if args.plot:
            check_plot_path(args.plot)
        runs = run_tiers(workload, args.model, args.kv_cache_dtype, args.kv_disk_cache)
        if args.plot:
            title = (f"{workload.conversations} conversations × {workload.turns} turns, round-robin, on a pool "
                     f"holding {workload.pool_share:.0%} of them (--kv-cache-dtype {args.kv_cache_dtype})")
            ttfts = {run.name: [(t.history_tokens, t.ttft_s) for t in run.returning] for run in runs}
            plot_tiers(args.plot, title, ttfts, {run.name: run.prefilled_tokens for run in runs}, runs[0].new_tokens)
            print(f"plot written to {args.plot}")
    except ValueError as exc:
        raise SystemExit(f"kvserve bench multiturn: {exc}") from exc
    return 0


def run_tiers(workload: TierWorkload, model: str | None = None, kv_cache_dtype: str = "auto",
              disk_dir: str | None = None, console=None,
              sequential_bytes: int = SEQUENTIAL_FILE_BYTES) -> list[TierRun]:
    """The three runs, printed as one table; `disk_dir` (default: a temporary directory, removed after) holds the
    tier's records, and a `sequential_bytes` file for the plain read rate."""
    import torch
    from rich.console import Console

    console = console or Console(width=132)  # the table's ten columns
    directory = Path(disk_dir) if disk_dir else Path(tempfile.mkdtemp(prefix="kvserve-tier-bench-"))
    options = dict(model=model, kv_cache_dtype=kv_cache_dtype, max_model_len=workload.max_len_tokens)
    options["kv_cache_memory"] = _pool_bytes(workload, options)
    console.print(f"{workload.conversations} conversations × {workload.turns} turns, round-robin: first prompt "
                  f"{workload.first_tokens} tokens, +{workload.question_tokens}-token questions, "
                  f"{workload.answer_tokens}-token answers (greedy, EOS ignored); KV pool {options['kv_cache_memory']}"
                  f" bytes (~{workload.pool_share:.0%} of all conversations); torch threads: {torch.get_num_threads()}")
    try:
        runs = [_run(workload, "pool only", options, None, False, console),
                _run(workload, "disk tier", options, directory / "warm", False, console),
                _run(workload, f"disk tier, restart after turn {workload.restart_after}", options,
                     directory / "restart", True, console)]
        cold_s, warm_s = _sequential_read_s(directory, sequential_bytes)
    finally:
        if not disk_dir:
            shutil.rmtree(directory, ignore_errors=True)
    if any(run.answers != runs[0].answers for run in runs[1:]):
        console.print("[yellow]note: some answers differ between runs (float rounding of a near-tie)[/yellow]")
    _print_table(console, runs, sequential_bytes, cold_s, warm_s)
    return runs


def _pool_bytes(workload: TierWorkload, options: dict) -> int:
    """A pool holding `pool_share` of every conversation's full length, and at least one longest request."""
    from kvserve.config import EngineConfig
    from kvserve.model.loader import resolve_model
    from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype
    from kvserve.planner.model_spec import ModelSpec

    config = EngineConfig(model=options["model"], kv_cache_dtype=options["kv_cache_dtype"])
    spec = ModelSpec.from_hf_config(json.loads((resolve_model(config.model).path / "config.json").read_text()))
    per_token = kv_bytes_per_token(spec, resolve_kv_dtype(config.kv_cache_format, spec), config.block_size)
    tokens = max(workload.pool_share * workload.conversations * workload.max_len_tokens,
                 workload.max_len_tokens + 64)
    return int(tokens * per_token)


def _run(workload: TierWorkload, name: str, options: dict, disk_dir: Path | None, restart: bool,
         console) -> TierRun:
    from kvserve.engine.llm import LLM

    def start() -> LLM:
        llm = LLM(**options, **({"kv_disk_cache": str(disk_dir)} if disk_dir else {}))
        warm_up = Conversation(workload.first_tokens, 1, 1, 1, seed=workload.seed + 10_000)
        llm.generate(warm_up.questions(llm.engine.model_config.vocab_size)[0], SamplingParams(max_tokens=1))
        return llm

    run, llm = TierRun(name), start()
    params = SamplingParams(max_tokens=workload.answer_tokens, temperature=0.0, ignore_eos=True)
    questions = workload.questions(llm.engine.model_config.vocab_size)
    histories: list[list[int]] = [[] for _ in questions]
    baseline = llm.stats()
    started = time.perf_counter()
    for turn in range(workload.turns):
        if restart and turn == workload.restart_after:
            run.prefilled_tokens += llm.stats()["num_prefill_tokens"] - baseline["num_prefill_tokens"]
            llm.engine.disk_cache.store.flush()
            run.add_disk_stats(_delta(llm.stats(), baseline))
            del llm
            gc.collect()
            _drop_page_cache(disk_dir)
            llm = start()
            baseline = llm.stats()
        for c, conversation in enumerate(questions):
            prompt = histories[c] + conversation[turn]
            output = llm.generate(prompt, params)[0]
            run.new_tokens += len(conversation[turn])
            if turn:
                metrics = output.metrics
                run.returning.append(ReturningTurn(len(histories[c]), output.num_cached_tokens,
                                                   metrics.first_token_time - metrics.arrival_time))
            run.answers.append(output.outputs[0].token_ids)
            histories[c] = prompt + output.outputs[0].token_ids
        console.print(f"  {name}: turn {turn + 1} done ({time.perf_counter() - started:,.0f} s)", style="dim")
    if llm.engine.disk_cache is not None:
        llm.engine.disk_cache.store.flush()
    run.prefilled_tokens += llm.stats()["num_prefill_tokens"] - baseline["num_prefill_tokens"]
    run.add_disk_stats(_delta(llm.stats(), baseline))
    del llm
    gc.collect()
    return run


def _delta(after: dict, before: dict) -> dict:
    return {key: value - before.get(key, 0) for key, value in after.items() if isinstance(value, (int, float))}


def _drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under `directory` (written back first)."""
    for path in directory.rglob("*"):
        if path.is_file():
            _drop_file_pages(path)


def _drop_file_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sequential_read_s(directory: Path, num_bytes: int) -> tuple[float, float]:
    """Seconds to read a `num_bytes` file in `directory` in 16 MiB reads: out of the page cache, then from it."""
    path = directory / "sequential-read.bin"
    with open(path, "wb") as file:
        for _ in range(max(1, num_bytes // (16 * 2**20))):
            file.write(os.urandom(16 * 2**20))
    try:
        _drop_file_pages(path)
        return _read_all_s(path), _read_all_s(path)
    finally:
        path.unlink()


def _read_all_s(path: Path) -> float:
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        while file.read(16 * 2**20):
            pass
    return time.perf_counter() - started


def _percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _print_table(console, runs: list[TierRun], sequential_bytes: int, cold_s: float, warm_s: float) -> None:
    from rich.table import Table

    table = Table(title="Returning conversations: what the pool alone, a disk tier, and a restart compute")
    for column in ["run", "prefilled\ntokens", "× new\ninput", "cached\nshare", "TTFT p50\nms", "TTFT p99\nms",
                   f"p50 ms,\nhistory\n≥ {LONG_HISTORY_TOKENS:,}", "read\nMB", "written\nMB", "tier read\nMB/s"]:
        table.add_column(column, justify="right")
    for run in runs:
        ttfts = [t.ttft_s * 1e3 for t in run.returning]
        long = [t.ttft_s * 1e3 for t in run.returning if t.history_tokens >= LONG_HISTORY_TOKENS]
        share = sum(t.cached_tokens for t in run.returning) / sum(t.history_tokens for t in run.returning)
        rate = f"{run.bytes_read / run.read_s / 1e6:,.0f}" if run.read_s else "—"
        table.add_row(run.name, f"{run.prefilled_tokens:,}", f"{run.prefilled_tokens / run.new_tokens:.2f}",
                      f"{share:.1%}", f"{_percentile(ttfts, 50):,.0f}", f"{_percentile(ttfts, 99):,.0f}",
                      f"{_percentile(long, 50):,.0f}" if long else "—", f"{run.bytes_read / 1e6:,.0f}",
                      f"{run.bytes_written / 1e6:,.0f}", rate)
    console.print(table)
    size_mb = sequential_bytes / 1e6
    console.print(f"sequential read of a {sequential_bytes // 2**20} MiB file in the same directory: "
                  f"{size_mb / cold_s:,.0f} MB/s out of the page cache, {size_mb / warm_s:,.0f} MB/s from it")
    console.print("cached share: prompt tokens found cached (pool or disk) ÷ history tokens, returning turns; "
                  "TTFT: returning turns only")
