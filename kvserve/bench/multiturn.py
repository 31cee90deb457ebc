"""`kvserve bench multiturn`: one growing conversation, with and without prefix caching, turn by turn.

Turn 1 sends a --first-token prompt; every later turn sends the whole history (all earlier prompts and answers)
plus a new --question-token question. Prompts are random token ids (fixed seed) and answers are greedy, EOS
ignored, exactly --answer tokens, so both runs see the same conversation. Per turn it prints the prompt length,
the tokens prefilled (computed, from the engine's stats), the tokens reused from the cache and the time to first
token, then the ratios at the last turn and over all turns.

The cached run generates the answers; the run without the cache replays the same prompts with max_tokens=1,
since neither what it prefills nor its time to first token depends on decoding the answer (without the cache
nothing outlives a turn), and checks it starts each answer with the same token. On the embedded SmolLM2 on a
2-core CPU the full default run (10 turns, 500-token answers) takes about 9 minutes, most of it decoding the
answers at up to 7,500 tokens of context; `--answer 20` takes about a minute.

On a hybrid model (`--hybrid-model`, or a Qwen3-Next / Qwen3.5 directory) a hit resumes from the state checkpoint
at the deepest block boundary inside it, so a returning turn prefills from there: the bench also prints the
checkpoints held and their memory, and how many admissions resumed from one. Each running sequence holds a state
slot (and prefix caching as many checkpoints again) out of --kv-cache-memory: --max-num-seqs sizes them.

`--shared-first` sends --turns separate requests instead of one conversation: each the --first-token prompt (a
system prompt they share) and its own --question tokens, as users of one assistant or agents of one framework do.
On a hybrid model a hit needs a state checkpoint where the requests part (resume.py: a branch point, and every
256 tokens), so what each request prefills shows where they are saved."""
from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, replace

from kvserve.bench.conversation import Conversation
from kvserve.bench.hybrid_model import add_hybrid_model_argument, resolve_hybrid_model_argument
from kvserve.bench.tiers import add_tier_arguments, run_tiers_from_args
from kvserve.plots import check_plot_path, plot_multiturn
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    prefilled_tokens: int  # computed this turn (prompt tokens not found in the cache)
    cached_tokens: int
    ttft_s: float
    token_ids: list[int]  # the answer


def run_conversation(llm, conversation: Conversation, answers: list[list[int]] | None = None,
                     progress=None, shared_first: bool = False) -> list[Turn]:
    """Hold the conversation, generating the answers, or replaying given ones with one generated token a turn;
    `progress(turn_number, turn)` is called after each turn. `shared_first`: each turn is a request of its own, the
    first prompt and its question (a conversation of n turns sends n - 1 requests)."""
    questions = conversation.questions(llm.engine.model_config.vocab_size)
    history: list[int] = []
    if shared_first:
        history, questions = questions[0], questions[1:]
    turns = []
    for i, question in enumerate(questions):
        prompt = history + question
        max_tokens = conversation.answer_tokens if answers is None else 1
        before = llm.stats()["num_prefill_tokens"]
        output = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
        metrics = output.metrics
        turns.append(Turn(len(prompt), llm.stats()["num_prefill_tokens"] - before, output.num_cached_tokens,
                          metrics.first_token_time - metrics.arrival_time, output.outputs[0].token_ids))
        if not shared_first:
            history = prompt + (answers[i] if answers is not None else output.outputs[0].token_ids)
        if progress is not None:
            progress(i + 1, turns[-1])
    return turns


def run_multiturn(conversation: Conversation, model: str | None = None, kv_cache_memory: str = "1GiB",
                  max_model_len: int = 8192, console=None, max_num_seqs: int | None = None,
                  shared_first: bool = False) -> dict[str, list[Turn]]:
    """Run the conversation with and then without prefix caching, print the per-turn table, return both runs.
    `shared_first`: --turns requests sharing the first prompt instead (run_conversation)."""
    import torch
    from rich.console import Console

    from kvserve.engine.llm import LLM

    longest = (conversation.first_tokens + conversation.question_tokens + conversation.answer_tokens if shared_first
               else conversation.max_len_tokens)
    if longest > max_model_len:
        raise ValueError(f"the conversation grows to {longest} tokens, more than max_model_len={max_model_len}; use "
                         "fewer turns or shorter turns")
    console = console or Console()
    unit = "request" if shared_first else "turn"
    if shared_first:
        conversation = replace(conversation, turns=conversation.turns + 1)
        console.print(f"{conversation.turns - 1} requests: a shared {conversation.first_tokens}-token first prompt "
                      f"and {conversation.question_tokens} tokens of their own; {conversation.answer_tokens}-token "
                      f"answers (greedy, EOS ignored); torch threads: {torch.get_num_threads()}")
    else:
        console.print(f"conversation: {conversation.turns} turns; first prompt {conversation.first_tokens} tokens, "
                      f"then +{conversation.question_tokens}-token questions; {conversation.answer_tokens}-token "
                      f"answers (greedy, EOS ignored); torch threads: {torch.get_num_threads()}")
    runs: dict[str, list[Turn]] = {}
    for name, prefix_caching in (("prefix caching", True), ("no prefix caching", False)):
        llm = LLM(model, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                  enable_prefix_caching=prefix_caching, **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}))
        # warm-up at turn 1's size (its own tokens, so nothing of it is reused): first calls are slow
        warm_up = Conversation(conversation.first_tokens, 1, 1, 1, seed=conversation.seed + 1)
        run_conversation(llm, warm_up)
        answers = [t.token_ids for t in runs["prefix caching"]] if runs else None
        runs[name] = run_conversation(llm, conversation, answers, _progress(console, name, unit), shared_first)
        if prefix_caching:
            _print_state_checkpoints(console, llm)
        del llm
        gc.collect()
    cached, baseline = runs["prefix caching"], runs["no prefix caching"]
    if any(a.token_ids[:1] != b.token_ids for a, b in zip(cached, baseline)):
        console.print("[red]warning: the runs start an answer with different tokens[/red]")
    _print_table(console, cached, baseline, unit)
    return runs


def _progress(console, run_name: str, unit: str = "turn"):
    def report(turn_number: int, turn: Turn) -> None:
        console.print(f"  {run_name}: {unit} {turn_number} done, {turn.prefilled_tokens:,} tokens prefilled, "
                      f"TTFT {turn.ttft_s * 1e3:,.0f} ms", style="dim")
    return report


def _print_state_checkpoints(console, llm) -> None:
    """A hybrid model's state checkpoints after the cached run: how many, their memory, the hits that used one."""
    stats, plan = llm.stats(), llm.engine.cache_plan.state
    if plan is None:
        return
    held = stats["num_state_checkpoints"]
    console.print(f"state checkpoints: {held} held of {plan.num_checkpoints} slots x "
                  f"{plan.slot_bytes / 2**20:,.2f} MiB = {held * plan.slot_bytes / 2**20:,.1f} MiB held "
                  f"({plan.num_checkpoints * plan.slot_bytes / 2**20:,.1f} MiB reserved, beside "
                  f"{plan.num_slots} running slots); {stats['state_checkpoint_hits']} admissions resumed from one",
                  highlight=False, soft_wrap=True)


def _print_table(console, cached: list[Turn], baseline: list[Turn], unit: str = "turn") -> None:
    from rich.table import Table

    title = "Multi-turn conversation" if unit == "turn" else "Requests sharing a first prompt"
    table = Table(title=f"{title}: tokens prefilled and time to first token per {unit}")
    for column in [unit, "prompt\ntokens", "cache:\nprefilled", "cache:\nreused", "cache:\nTTFT ms",
                   "no cache:\nprefilled", "no cache:\nTTFT ms", "TTFT\nratio"]:
        table.add_column(column, justify="right")
    for i, (a, b) in enumerate(zip(cached, baseline), start=1):
        table.add_row(str(i), f"{a.prompt_tokens:,}", f"{a.prefilled_tokens:,}", f"{a.cached_tokens:,}",
                      f"{a.ttft_s * 1e3:,.0f}", f"{b.prefilled_tokens:,}", f"{b.ttft_s * 1e3:,.0f}",
                      f"{b.ttft_s / a.ttft_s:.1f}x")
    console.print(table)
    last_a, last_b = cached[-1], baseline[-1]
    console.print(f"{unit} {len(cached)}: {last_b.prefilled_tokens:,} vs {last_a.prefilled_tokens:,} tokens prefilled "
                  f"({last_b.prefilled_tokens / last_a.prefilled_tokens:.1f}x fewer), TTFT "
                  f"{last_b.ttft_s * 1e3:,.0f} vs {last_a.ttft_s * 1e3:,.0f} ms "
                  f"({last_b.ttft_s / last_a.ttft_s:.1f}x faster) with prefix caching")
    total_a = sum(t.prefilled_tokens for t in cached)
    total_b = sum(t.prefilled_tokens for t in baseline)
    ttft_a, ttft_b = sum(t.ttft_s for t in cached), sum(t.ttft_s for t in baseline)
    console.print(f"all {unit}s: {total_b:,} vs {total_a:,} tokens prefilled ({total_b / total_a:.1f}x fewer), "
                  f"summed TTFT {ttft_b:,.2f} vs {ttft_a:,.2f} s ({ttft_b / ttft_a:.1f}x faster)")
    if len(cached) > 1:
        back_a, back_b = sum(t.ttft_s for t in cached[1:]), sum(t.ttft_s for t in baseline[1:])
        later = "returning turns" if unit == "turn" else "later requests"
        console.print(f"{later} (2-{len(cached)}): mean TTFT {back_b / (len(cached) - 1) * 1e3:,.0f} vs "
                      f"{back_a / (len(cached) - 1) * 1e3:,.0f} ms ({back_b / back_a:.1f}x faster)", soft_wrap=True)


def add_multiturn_parser(bench_subparsers) -> None:
    c = Conversation()
    p = bench_subparsers.add_parser("multiturn", help="a growing conversation with and without prefix caching")
    p.add_argument("--first", type=int, default=c.first_tokens, help="turn 1's prompt tokens")
    p.add_argument("--question", type=int, default=c.question_tokens, help="new tokens each later turn adds")
    p.add_argument("--answer", type=int, default=c.answer_tokens,
                   help="answer tokens per turn (the full run takes minutes; --answer 20 is a quick one)")
    p.add_argument("--turns", type=int, default=c.turns)
    p.add_argument("--seed", type=int, default=c.seed)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    add_hybrid_model_argument(p)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's (default 64); a hybrid model's state slots and checkpoints come out of "
                        "--kv-cache-memory, one of each per sequence")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--plot", metavar="PATH",
                   help="also draw the tokens prefilled per turn, with and without prefix caching; with --tiers, "
                        "each run's TTFT per returning turn and its tokens prefilled (.png or .svg)")
    p.add_argument("--shared-first", action="store_true",
                   help="send --turns requests, each the first prompt (shared) and its own question, instead of one "
                        "conversation")
    add_tier_arguments(p)
    p.set_defaults(func=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    from rich.console import Console

    for name in ("first", "question", "answer", "turns"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvserve bench multiturn: --{name} must be at least 1, got {getattr(args, name)}")
    resolve_hybrid_model_argument(args, Console())
    if args.tiers:
        if args.shared_first:
            raise SystemExit("kvserve bench multiturn: --shared-first and --tiers are two workloads; give one")
        return run_tiers_from_args(args)
    conversation = Conversation(args.first, args.question, args.answer, args.turns, args.seed)
    try:
        if args.plot:
            check_plot_path(args.plot)
        runs = run_multiturn(conversation, args.model, args.kv_cache_memory, args.max_model_len,
                             max_num_seqs=args.max_num_seqs, shared_first=args.shared_first)
        if args.plot:
            cached, baseline = runs["prefix caching"], runs["no prefix caching"]
            plot_multiturn(args.plot, [t.prompt_tokens for t in cached], [t.prefilled_tokens for t in cached],
                           [t.prefilled_tokens for t in baseline])
            print(f"plot written to {args.plot}")
    except ValueError as exc:
        raise SystemExit(f"kvserve bench multiturn: {exc}") from exc
    return 0
