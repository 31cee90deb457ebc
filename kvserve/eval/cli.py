"""`kvserve eval`: one table of what each KV cache setting costs in quality, on the same model and text."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from kvserve.eval.ruler import TASKS as RULER_TASKS
from kvserve.eval.ruler_run import MIN_RULER_LENGTH, RulerPlan, RulerScores, print_ruler_tables
from kvserve.eval.settings import SWEPT_FIELDS, Setting, cross_product, parse_list, parse_setting

GiB = 1 << 30
EVAL_TASKS = ("ppl", "ruler")

_DESCRIPTION = """\
Measure what KV cache settings cost in quality, through the engine's own paged path, on one text.
Comma-separated values of --kv-cache-dtype (or --quantization, for the weights) give one setting each;
the first is the reference.

Perplexity uses windows of --context tokens every --stride tokens; each token after the first is scored
once, in the window where it is new. --streaming instead feeds the whole text through one sequence,
so a cache policy sees the whole history. KLD is the mean over scored positions of KL(reference || tested);
top-1 agreement is the share of positions whose most likely next token is unchanged.

--tasks ruler runs RULER-lite instead of (or with, "ppl,ruler") perplexity: needle retrieval (single, multi-key,
multi-value, multi-query) and variable tracking in prompts of --ruler-lengths tokens, generated from --seed with
the model's tokenizer, answered greedily; each task's score is the share of expected values found. Tasks the
reference scores below 60% are shown in brackets and left out of the averages.

What decode would see is what is measured: lossy formats are read back for every query, prefill included,
and settings with eviction prefill --chunk tokens per step (decode is one), so the policy acts while the
text is read rather than after it.
"""


@dataclass
class Row:
    """One setting's results; a None value is explained by its entry in `why`."""

    setting: Setting
    bytes_per_token: int | None = None
    max_tokens_per_sequence: int | None = None  # an eviction policy's bound (None: every token is kept)
    ppl: float | None = None
    delta_ppl_pct: float | None = None
    kld: float | None = None
    top1_agreement: float | None = None
    tokens_scored: int = 0
    passkey: dict[int, float] = field(default_factory=dict)
    ruler: RulerScores | None = None
    ruler_average: float | None = None  # over the (length, task) pairs the reference passes
    ruler_vs_reference: float | None = None
    ppl_by_segment: list[float] | None = None
    why: dict[str, str] = field(default_factory=dict)

    @property
    def tokens_in_gib(self) -> int | None:
        return GiB // self.bytes_per_token if self.bytes_per_token else None

    @property
    def passkey_accuracy(self) -> float | None:
        return sum(self.passkey.values()) / len(self.passkey) if self.passkey else None

    def to_json(self) -> dict[str, Any]:
        return {
            "setting": self.setting.label,
            "quantization": self.setting.value("quantization", "none"),
            "kv_cache_dtype": self.setting.value("kv_cache_dtype", "auto"),
            "kv_eviction": self.setting.value("kv_eviction", "none"),
            "bytes_per_token": self.bytes_per_token,
            "tokens_in_1gib": self.tokens_in_gib,
            "max_tokens_per_sequence": self.max_tokens_per_sequence,
            "ppl": self.ppl,
            "delta_ppl_pct": self.delta_ppl_pct,
            "kld": self.kld,
            "top1_agreement": self.top1_agreement,
            "tokens_scored": self.tokens_scored,
            "passkey_accuracy": self.passkey_accuracy,
            "passkey_by_length": {str(k): v for k, v in self.passkey.items()} or None,
            "ppl_by_segment": self.ppl_by_segment,
            "ruler": self.ruler.to_json() if self.ruler else None,
            "ruler_average": self.ruler_average,
            "ruler_vs_reference": self.ruler_vs_reference,
            "not_available": self.why or None,
        }


def add_parser(subparsers) -> None:
    from kvserve.engine.cli import add_engine_args

    p = subparsers.add_parser("eval", help="quality of KV cache settings: perplexity, KLD, top-1, passkey, RULER-lite",
                              description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, exclude=SWEPT_FIELDS)
    s = p.add_argument_group("settings (comma-separated lists; the first setting is the reference)")
    s.add_argument("--quantization", default="none", help="weights, e.g. none,int8 (default: none)")
    s.add_argument("--kv-cache-dtype", default="auto", help="e.g. auto,fp8,fp8_e5m2,int8,int4 (default: auto)")
    s.add_argument("--kv-eviction", default="none", help="e.g. none,streaming,h2o (default: none)")
    s.add_argument("--kv-sink-tokens", default="4", help="streaming/h2o sinks, e.g. 4,0 (default: 4)")
    s.add_argument("--kv-recent-tokens", default="1024", help="streaming/h2o recent window (default: 1024)")
    s.add_argument("--kv-budget-tokens", default="2048", help="h2o tokens kept in all (default: 2048)")
    s.add_argument("--setting", action="append", default=[], metavar="SPEC",
                   help="an explicit setting instead of the lists above, repeatable, e.g. "
                        "kv_eviction=streaming,kv_sink_tokens=0,kv_recent_tokens=1024")
    p.add_argument("--tasks", default="ppl",
                   help="what to measure, comma-separated: ppl (perplexity, KLD, top-1 over the text), ruler "
                        "(RULER-lite long-context retrieval) (default: ppl; passkey runs with --passkey-lengths)")
    t = p.add_argument_group("text")
    t.add_argument("--corpus", default=None, metavar="FILE",
                   help="UTF-8 text to score (default: Python's pydoc_data.topics, ~465K characters of English)")
    t.add_argument("--tokens", type=int, default=8192, help="score the text's first N tokens (default %(default)s)")
    t.add_argument("--context", type=int, default=2048, help="window length in tokens (default %(default)s)")
    t.add_argument("--stride", type=int, default=512, help="window step (default %(default)s)")
    t.add_argument("--chunk", type=int, default=32,
                   help="tokens per step for settings with eviction, and for all with --streaming (default %(default)s)")
    t.add_argument("--streaming", action="store_true", help="one sequence over the whole text instead of windows")
    t.add_argument("--segment", type=int, default=1024,
                   help="with --streaming, report perplexity per segment of N tokens (default %(default)s)")
    k = p.add_argument_group("passkey retrieval")
    k.add_argument("--passkey-lengths", default="", help="prompt lengths in tokens, e.g. 1024,4096 (default: none)")
    k.add_argument("--passkey-trials", type=int, default=5, help="trials per length (default %(default)s)")
    r = p.add_argument_group("RULER-lite retrieval (--tasks ruler; samples drawn from --seed)")
    r.add_argument("--ruler-tasks", default=",".join(RULER_TASKS), help="default: all, %(default)s")
    r.add_argument("--ruler-lengths", default="2048,4096", help="prompt lengths in tokens (default %(default)s)")
    r.add_argument("--ruler-samples", type=int, default=10, help="samples per task and length (default %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object per setting instead of the table")
    o.add_argument("--plot", default=None, metavar="FILE",
                   help="draw Δppl and KLD against bytes per token (PNG or SVG by extension)")
    p.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve eval: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from kvserve.config import EngineConfig
    from kvserve.engine.cli import engine_config_from_args
    from kvserve.eval.corpus import load_corpus
    from kvserve.eval.windows import sliding_windows

    settings = [parse_setting(spec) for spec in args.setting] or cross_product({
        "quantization": parse_list(args.quantization),
        "kv_cache_dtype": parse_list(args.kv_cache_dtype),
        "kv_eviction": parse_list(args.kv_eviction),
        "kv_sink_tokens": parse_list(args.kv_sink_tokens, int),
        "kv_recent_tokens": parse_list(args.kv_recent_tokens, int),
        "kv_budget_tokens": parse_list(args.kv_budget_tokens, int),
    })
    shared = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in SWEPT_FIELDS})
    base = dataclasses.asdict(engine_config_from_args(shared))
    configs = [EngineConfig(**{**base, **s.options}) for s in settings]  # bad values fail here, before loading
    lengths = parse_list(args.passkey_lengths, int) if args.passkey_lengths else []
    args.task_list, args.ruler_plan = _parse_tasks(args)
    if args.passkey_trials < 1 or any(n < 64 for n in lengths):
        raise ValueError("passkey trials must be at least 1 and lengths at least 64 tokens")
    if args.tokens < 2:
        raise ValueError(f"--tokens must be at least 2, got {args.tokens}")
    if args.chunk < 1:
        raise ValueError(f"--chunk must be positive, got {args.chunk}")
    if not args.streaming:
        sliding_windows(args.tokens, args.context, args.stride)  # checks stride < context
    corpus = load_corpus(args.corpus)
    if args.plot:
        from kvserve.plots import check_plot_path

        check_plot_path(args.plot)
    return _evaluate(args, settings, configs, corpus, lengths)


def _parse_tasks(args: argparse.Namespace) -> tuple[list[str], RulerPlan | None]:
    tasks = parse_list(args.tasks)
    if not set(tasks) <= set(EVAL_TASKS):
        raise ValueError(f"--tasks {args.tasks!r}: choose from {', '.join(EVAL_TASKS)}")
    if "ruler" not in tasks:
        return tasks, None
    ruler_tasks = parse_list(args.ruler_tasks)
    if not set(ruler_tasks) <= set(RULER_TASKS):
        raise ValueError(f"--ruler-tasks {args.ruler_tasks!r}: choose from {', '.join(RULER_TASKS)}")
    ruler_lengths = parse_list(args.ruler_lengths, int)
    if args.ruler_samples < 1 or any(n < MIN_RULER_LENGTH for n in ruler_lengths):
        raise ValueError(f"--ruler-samples must be at least 1 and --ruler-lengths at least {MIN_RULER_LENGTH} tokens")
    return tasks, RulerPlan(ruler_tasks, ruler_lengths, args.ruler_samples, args.seed)


def _evaluate(args, settings: list[Setting], configs, corpus, lengths: list[int]) -> int:
    from rich.console import Console

    from kvserve.engine.llm import LLM

    console = Console(stderr=True)
    llms = []
    for config in configs:
        if args.streaming or config.kv_eviction != "none":
            config = dataclasses.replace(config, max_num_batched_tokens=args.chunk)
        llms.append(LLM(**dataclasses.asdict(config)))
    reference = llms[0].engine
    if reference.tokenizer is None:
        raise ValueError("kvserve eval needs a model with a tokenizer")
    token_ids = []
    if "ppl" in args.task_list:
        token_ids = reference.tokenizer(corpus.text, verbose=False).input_ids[: args.tokens]
        if len(token_ids) < args.tokens:
            raise ValueError(f"the corpus has only {len(token_ids):,} tokens, fewer than --tokens {args.tokens:,}")
        if not args.streaming and args.context > reference.max_model_len:
            raise ValueError(f"--context {args.context} exceeds max_model_len {reference.max_model_len}")
    rows = _run_all(args, settings, llms, token_ids, lengths, console)
    header = {
        "model": reference.model_name, "corpus": corpus.name, "corpus_sha256": corpus.sha256,
        "tokens": len(token_ids), "mode": "streaming" if args.streaming else "windows",
        "context": None if args.streaming else args.context, "stride": None if args.streaming else args.stride,
        "chunk": args.chunk,
        "passkey_lengths": lengths, "passkey_trials": args.passkey_trials if lengths else 0,
        **(args.ruler_plan.header() if args.ruler_plan else {}),
    }
    if args.json:
        for row in rows:
            print(json.dumps({**header, **row.to_json()}))
    else:
        if "ppl" in args.task_list or lengths:
            _print_table(header, rows)
        if args.ruler_plan:
            print_ruler_tables([row.setting.label for row in rows], [row.ruler for row in rows], args.ruler_plan)
    if args.plot and "ppl" in args.task_list:
        from kvserve.plots import plot_quality_vs_bytes

        shown = [row for row in rows if row.ppl is not None]
        plot_quality_vs_bytes(args.plot, f"{reference.model_name} on {corpus.name}: quality against KV size", {
            "Δ perplexity vs reference (%)": [(r.setting.label, r.bytes_per_token, r.delta_ppl_pct) for r in shown
                                              if r.delta_ppl_pct is not None],
            "mean KL divergence vs reference": [(r.setting.label, r.bytes_per_token, r.kld) for r in shown
                                                if r.kld is not None],
        })
    return 0


def _run_all(args, settings, llms, token_ids, lengths, console) -> list[Row]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvserve.eval import harness
    from kvserve.eval.passkey import make_trials
    from kvserve.eval.windows import sliding_windows

    rows = [Row(s, llm.engine.cache_plan.kv_bytes_per_token, _max_tokens(llm.engine)) for s, llm in zip(settings, llms)]
    text = "ppl" in args.task_list
    windows = [] if args.streaming or not text else sliding_windows(len(token_ids), args.context, args.stride)
    stream_steps = -(-len(token_ids) // args.chunk) if args.streaming and text else 0
    trials = {n: make_trials(llms[0].tokenizer, n, args.passkey_trials, args.seed) for n in lengths}
    ruler_samples = args.ruler_plan.make_samples(llms[0].tokenizer) if args.ruler_plan else {}
    work = (len(windows) + len(lengths) + len(ruler_samples)) * len(llms) + stream_steps
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task("evaluating", total=work)
        advance = lambda: progress.advance(task)  # noqa: E731
        if not text:
            for row in rows:
                row.why["ppl"] = row.why["kld"] = "not run (--tasks)"
        elif args.streaming:
            _score_stream(args, rows, llms, token_ids, advance)
        else:
            for row, totals in zip(rows, harness.score_windows(llms, token_ids, windows, advance)):
                _fill(row, totals, True)
        for n, length_trials in trials.items():
            for row, llm in zip(rows, llms):
                if n + harness.ANSWER_TOKENS > llm.engine.max_model_len:
                    row.why[f"passkey {n}"] = "n/a: longer than max_model_len"
                else:
                    row.passkey[n] = harness.passkey_accuracy(llm, length_trials)
                advance()
        if ruler_samples:
            _run_ruler(rows, llms, ruler_samples, advance)
    reference_ppl = rows[0].ppl
    for row in rows:
        if row.ppl is not None and reference_ppl is not None:
            row.delta_ppl_pct = 100 * (row.ppl / reference_ppl - 1)
    return rows


def _score_stream(args, rows: list[Row], llms, token_ids: list[int], advance) -> None:
    from kvserve.eval import harness

    fits = [llm.engine.eviction.unbounded_length or len(token_ids) + 2 <= llm.engine.max_model_len for llm in llms]
    running = [llm for llm, ok in zip(llms, fits) if ok]
    with_reference = fits[0]
    results = iter(harness.score_stream(running, token_ids, with_reference, args.segment, advance))
    for row, ok in zip(rows, fits):
        if not ok:
            row.why["ppl"] = f"n/a: {len(token_ids):,} tokens exceed max_model_len"
            continue
        result = next(results)
        _fill(row, result.totals, with_reference)
        row.ppl_by_segment = [math.exp(nll / n) for nll, n in zip(result.segment_nll, result.segment_tokens)]
    if not with_reference:
        for row in rows:
            row.why.setdefault("kld", f"n/a: no reference (text longer than {llms[0].engine.max_model_len:,} tokens)")


def _run_ruler(rows: list[Row], llms, samples_by_length, advance) -> None:
    """Every setting through every length's samples; averages over what the reference (the first row) passes."""
    from kvserve.eval.ruler_run import included_pairs, run_length

    for row, llm in zip(rows, llms):
        row.ruler = RulerScores()
        for samples in samples_by_length.values():
            run_length(llm, samples, row.ruler)
            advance()
    included = included_pairs(rows[0].ruler)
    reference_average = rows[0].ruler.average(included)
    for row in rows:
        row.ruler_average = row.ruler.average(included)
        if row.ruler_average is not None and reference_average:
            row.ruler_vs_reference = row.ruler_average / reference_average


def _max_tokens(engine) -> int | None:
    max_blocks = engine.eviction.max_blocks(engine.kv.block_size)
    return max_blocks * engine.kv.block_size if max_blocks is not None else None


def _fill(row: Row, totals, with_reference: bool) -> None:
    row.tokens_scored = totals.tokens_scored
    row.ppl = totals.ppl
    if with_reference:
        row.kld, row.top1_agreement = totals.kld, totals.top1_agreement


def _print_table(header: dict[str, Any], rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    where = f"context {header['context']}, stride {header['stride']}" if header["mode"] == "windows" else \
        f"one sequence, {header['chunk']} tokens per step"
    console.print(f"model {header['model']}; text {header['corpus']} (sha256 {header['corpus_sha256'][:12]}), "
                  f"first {header['tokens']:,} tokens; {where}")
    table = Table()
    for column in ("setting", "bytes/token", "tokens in 1 GiB", "kept per sequence", "ppl", "Δppl",
                   "mean KLD vs reference", "top-1 agreement", "passkey"):
        table.add_column(column, justify="left" if column in ("setting", "passkey") else "right")
    for row in rows:
        table.add_row(
            row.setting.label,
            f"{row.bytes_per_token:,}",
            f"{row.tokens_in_gib:,}",
            f"≤ {row.max_tokens_per_sequence:,} tokens" if row.max_tokens_per_sequence else "all",
            _cell(row, "ppl", row.ppl, "{:.3f}"),
            _cell(row, "ppl", row.delta_ppl_pct, "{:+.2f}%"),
            _cell(row, "kld", row.kld, "{:.5f}"),
            _cell(row, "kld", row.top1_agreement, "{:.2%}"),
            _passkey_cell(row, header),
        )
    console.print(table)
    scored = {row.tokens_scored for row in rows if row.tokens_scored}
    console.print(f"tokens scored per setting: {', '.join(f'{n:,}' for n in sorted(scored))}")


def _cell(row: Row, key: str, value: float | None, fmt: str) -> str:
    return fmt.format(value) if value is not None else row.why.get(key, "n/a")


def _passkey_cell(row: Row, header: dict[str, Any]) -> str:
    if not header["passkey_lengths"]:
        return "n/a: not run (--passkey-lengths)"
    parts = [f"{n}: {row.passkey[n]:.0%}" if n in row.passkey else f"{n}: n/a" for n in header["passkey_lengths"]]
    return ", ".join(parts)
