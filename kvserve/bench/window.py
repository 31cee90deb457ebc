"""`kvserve bench window`: the KV memory one long request really holds on a sliding-window or hybrid model, against
what a uniform cache (every layer keeps every token) would hold for it.

One request of --tokens tokens (random ids, fixed seed) is prefilled and decodes --decode tokens. After every step
the blocks it holds are counted per layer group: the largest count, times the block size in bytes, is what it
holds between steps (what decoding holds, and what the planner predicts). During a prefill step a sliding group
briefly holds the whole chunk too (--max-num-batched-tokens tokens), before the step frees what fell out of the
window: that peak is printed as well."""
from __future__ import annotations

import argparse


def add_window_parser(bench_subparsers) -> None:
    from kvserve.engine.cli import add_engine_args

    p = bench_subparsers.add_parser("window", help="KV bytes one long request holds on a sliding-window/hybrid model")
    add_engine_args(p)
    p.add_argument("--tokens", type=int, default=8192, help="prompt length (default %(default)s)")
    p.add_argument("--decode", type=int, default=16, help="tokens to generate after it (default %(default)s)")
    p.set_defaults(func=run_window, model="gemma3-270m", max_model_len=None)


def run_window(args: argparse.Namespace) -> int:
    import dataclasses

    import torch
    from rich.console import Console

    from kvserve.engine.cli import engine_config_from_args
    from kvserve.engine.llm import LLM
    from kvserve.planner.units import format_bytes
    from kvserve.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    if config.max_model_len is None:
        config = dataclasses.replace(config, max_model_len=args.tokens + args.decode)
    llm = LLM(**dataclasses.asdict(config))
    engine, console = llm.engine, Console()
    layout, plan = engine.layout, engine.cache_plan
    prompt = torch.randint(100, engine.model_config.vocab_size - 100, (args.tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("window", prompt, SamplingParams(max_tokens=args.decode, temperature=0, ignore_eos=True))
    held, peak = [0] * layout.num_groups, [0]
    run = engine.runner.run

    def counting_run(out):  # blocks allocated for this step, before the step drops what its window passed
        peak[0] = max(peak[0], len(engine.kv.block_ids("window")))
        return run(out)

    engine.runner.run = counting_run
    while engine.has_unfinished_requests():
        engine.step()
        if "window" in engine.requests:
            for g in range(layout.num_groups):
                held[g] = max(held[g], len(engine.kv.block_table("window", g).blocks))
    tokens = args.tokens + args.decode
    held_bytes = sum(held) * plan.block_bytes
    uniform_bytes = -(-tokens // plan.block_size) * plan.block_size * plan.kv_bytes_per_token
    console.print(f"{engine.model_name}: {layout.describe() or 'one group of every layer'}; blocks of "
                  f"{plan.block_size} tokens × {plan.layers_per_block} layers = {format_bytes(plan.block_bytes)}")
    for kind in sorted(set(layout.windows), key=lambda w: (w is not None, w or 0)):
        groups = [g for g, w in enumerate(layout.windows) if w == kind]
        name = "full attention" if kind is None else f"sliding window {kind:,}"
        console.print(f"  {len(groups)} {name} group(s): at most {max(held[g] for g in groups):,} blocks each")
    console.print(f"one {tokens:,}-token request holds {format_bytes(held_bytes)} of KV cache between steps (the "
                  f"planner predicts {format_bytes(plan.request_bytes(tokens))}); a uniform cache holds "
                  f"{format_bytes(uniform_bytes)} for it: {uniform_bytes / held_bytes:.2f}x more", highlight=False)
    console.print(f"peak within a prefill step of {config.max_num_batched_tokens:,} tokens: "
                  f"{format_bytes(peak[0] * plan.block_bytes)}", highlight=False)
    return 0
