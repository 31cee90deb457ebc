"""`kvserve bench agent-loop`: tool-calling agents, each turn a tool call fed back its result, on a KV pool that
holds about one agent, with and without the disk tier.

Every agent shares one system prompt and tool list (three functions) and gets its own task; each turn it answers
with one tool call (`tool_choice: "required"`, constrained, greedy, so always valid), and the call and a tool result
of --result-words random words go back into the conversation, which is sent whole the next turn through
`LLM.chat(..., tools=...)`, as an agent framework does over the OpenAI API. Agents take turns round-robin, so
between two turns of one agent the others run and the pool's LRU evicts it: without the tier a returning agent finds
only the shared system prompt and tools cached, with it the rest comes back from disk. Per turn (all agents) it
prints the prompt tokens, the share found cached and the mean time to first token, for both runs."""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench.words import WORDS
from kvserve.sampling_params import SamplingParams

SYSTEM = "You are a coding agent. Use the tools to inspect the repository and fix the failing test."
TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
    "type": "object", "required": [argument], "additionalProperties": False,
    "properties": {argument: {"type": "string", "maxLength": 24}}}}}
    for name, description, argument in (("search", "Search the code for a text", "query"),
                                        ("read_file", "Read a file of the repository", "path"),
                                        ("run_tests", "Run the tests matching a pattern", "pattern"))]
MAX_CALL_TOKENS = 96


@dataclass(frozen=True)
class AgentWorkload:
    agents: int = 4
    turns: int = 12
    result_words: int = 120  # each tool result, about a token a word
    pool_agents: float = 1.5  # the pool holds about this many agents' final contexts
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("agents", "turns", "result_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.pool_agents <= 0:
            raise ValueError(f"--pool-agents must be positive, got {self.pool_agents}")

    def task(self, agent: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + agent)
        return "The failing test: " + " ".join(rng.choices(WORDS, k=40))

    def result(self, agent: int, turn: int) -> str:
        rng = random.Random((self.seed * 1_000_003 + agent) * 1_009 + turn)
        return " ".join(rng.choices(WORDS, k=self.result_words))


@dataclass
class TurnStats:
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)

    @property
    def cached_share(self) -> float:
        return sum(self.cached_tokens) / sum(self.prompt_tokens)


@dataclass
class AgentRun:
    name: str
    turns: list[TurnStats]
    calls: list[list[str]]  # each agent's calls, name and arguments, to compare the runs
    disk_bytes_read: int = 0


def run_agents(workload: AgentWorkload, llm, name: str) -> AgentRun:
    """Every agent's turns, round-robin, on one engine."""
    params = SamplingParams(max_tokens=MAX_CALL_TOKENS, temperature=0.0)
    histories = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": workload.task(a)}]
                 for a in range(workload.agents)]
    run = AgentRun(name, [TurnStats() for _ in range(workload.turns)], [[] for _ in range(workload.agents)])
    for turn, stats in enumerate(run.turns):
        for agent, history in enumerate(histories):
            output = llm.chat(history, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
            stats.prompt_tokens.append(len(output.prompt_token_ids))
            stats.cached_tokens.append(output.num_cached_tokens)
            stats.ttft_s.append(output.metrics.first_token_time - output.metrics.arrival_time)
            (call,) = output.outputs[0].tool_calls  # constrained: exactly one valid call
            run.calls[agent].append(f"{call['name']}({call['arguments']})")
            history.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                    "arguments": call["arguments"]}}]})
            history.append({"role": "tool", "tool_call_id": call["id"], "content": workload.result(agent, turn)})
    run.disk_bytes_read = llm.stats().get("disk_cache_bytes_read", 0)
    return run


def run_agent_loop(workload: AgentWorkload, model: str | None = None, console=None) -> list[AgentRun]:
    """Both runs (the pool alone, then with a disk tier in a temporary directory), printed as one table."""
    import torch
    from rich.console import Console

    from kvserve.engine.llm import LLM

    console = console or Console(width=120)
    max_len = _final_tokens_estimate(workload, model) + MAX_CALL_TOKENS
    # the pool holds at least one longest request (the engine refuses to start otherwise)
    pool = int(max(workload.pool_agents * max_len, max_len + 64) * _kv_bytes_per_token(model))
    console.print(f"{workload.agents} agents × {workload.turns} turns, round-robin, one required tool call a turn "
                  f"and a {workload.result_words}-word result; KV pool {pool / 2**20:.0f} MiB (about "
                  f"{workload.pool_agents} agents' final context); torch threads: {torch.get_num_threads()}")
    directory = Path(tempfile.mkdtemp(prefix="kvserve-agent-bench-"))
    runs = []
    try:
        for name, disk in (("pool only", None), ("disk tier", str(directory))):
            llm = LLM(model, kv_cache_memory=pool, max_model_len=max_len,
                      **({"kv_disk_cache": disk} if disk else {}))
            llm.chat([{"role": "user", "content": "warm up"}], SamplingParams(max_tokens=2))
            llm.reset_prefix_cache()
            runs.append(run_agents(workload, llm, name))
            del llm
            gc.collect()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if runs[0].calls != runs[1].calls:
        console.print("[yellow]note: some calls differ between runs (float rounding of a near-tie)[/yellow]")
    _print_table(console, runs)
    return runs


def _kv_bytes_per_token(model: str | None) -> int:
    """The model's KV bytes per token in the engine's default format (the planner's arithmetic)."""
    from kvserve.config import EngineConfig
    from kvserve.model.loader import resolve_model
    from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype
    from kvserve.planner.model_spec import ModelSpec

    config = EngineConfig(model=model)
    spec = ModelSpec.from_hf_config(json.loads((resolve_model(config.model).path / "config.json").read_text()))
    return kv_bytes_per_token(spec, resolve_kv_dtype(config.kv_cache_format, spec), config.block_size)


def _final_tokens_estimate(workload: AgentWorkload, model: str | None) -> int:
    """An agent's last prompt, about: its first (tools, system prompt, task), and per turn a call and a result."""
    import transformers

    from kvserve.engine import tool_parsers
    from kvserve.engine.chat_prompt import render_chat
    from kvserve.engine.tools import ToolRequest
    from kvserve.model.loader import resolve_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(model).path)
    request = ToolRequest.from_openai(TOOLS, "required", tool_format=tool_parsers.for_tokenizer("auto", tokenizer))
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": workload.task(0)}]
    count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    first_tokens = count(render_chat(tokenizer, request.messages(first), request.template_tools()))
    per_turn = count(workload.result(0, 0)) + MAX_CALL_TOKENS // 2 + 16  # a call, and each turn's markers
    return first_tokens + workload.turns * per_turn


def _print_table(console, runs: list[AgentRun]) -> None:
    from rich.table import Table

    table = Table(title="Agent loop: prompt tokens found cached and time to first token per turn (mean over agents)")
    table.add_column("turn", justify="right")
    table.add_column("prompt\ntokens", justify="right")
    for run in runs:
        table.add_column(f"{run.name}:\ncached", justify="right")
        table.add_column(f"{run.name}:\nTTFT ms", justify="right")
    for i, turns in enumerate(zip(*(run.turns for run in runs)), start=1):
        cells = [f"{statistics.mean(turns[0].prompt_tokens):,.0f}"]
        for stats in turns:
            cells += [f"{stats.cached_share:.0%}", f"{statistics.mean(stats.ttft_s) * 1e3:,.0f}"]
        table.add_row(str(i), *cells)
    console.print(table)
    for run in runs:
        prompt = sum(sum(t.prompt_tokens) for t in run.turns)
        cached = sum(sum(t.cached_tokens) for t in run.turns)
        ttft = statistics.mean(x for t in run.turns for x in t.ttft_s)
        console.print(f"{run.name}: {cached:,} of {prompt:,} prompt tokens cached ({cached / prompt:.0%}), mean TTFT "
                      f"{ttft * 1e3:,.0f} ms, {run.disk_bytes_read / 2**20:,.1f} MiB read from the disk tier")


def add_agent_loop_parser(bench_subparsers) -> None:
    w = AgentWorkload()
    p = bench_subparsers.add_parser("agent-loop", help="tool-calling agents round-robin, without and with the disk tier")
    p.add_argument("--agents", type=int, default=w.agents)
    p.add_argument("--turns", type=int, default=w.turns)
    p.add_argument("--result-words", type=int, default=w.result_words, help="words of each tool result")
    p.add_argument("--pool-agents", type=float, default=w.pool_agents,
                   help="the KV pool holds about this many agents' final contexts (default %(default)s)")
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.set_defaults(func=_run_from_args)


def _run_from_args(args: argparse.Namespace) -> int:
    try:
        workload = AgentWorkload(args.agents, args.turns, args.result_words, args.pool_agents, args.seed)
        run_agent_loop(workload, args.model)
    except ValueError as exc:
        raise SystemExit(f"kvserve bench agent-loop: {exc}") from exc
    return 0
