"""`python -m kvserve.bench.delta_rule`: what the gated delta rule (model/gated_delta.py) costs where hybrid models
meet speculative decoding and batch invariance, on one linear layer of the shape of a planner preset's (random
inputs, fixed seed; medians of --repeat runs, the candidates taking turns).

- Verification: a drafted sequence's 1 + k tokens through the chunked form and, when a draft token was rejected,
  the accepted ones again from the state before the step (what the engine runs, kv/draft_states.py), against the
  token-by-token form, which makes every token's state to roll back to; with the bytes each keeps per drafted
  sequence until its draft is verified.
- Batch invariance: how far apart a prompt's outputs and final state come when its chunks are cut at another
  place (the scheduler cuts by the step's token budget, which other requests share), recurrent decode of one
  sequence batched and alone, and what running a prompt token by token (the one cut-independent form) costs
  against the chunked form.
- Prompt batching: a step's prompt chunks through the chunked form in calls of 1, 2, 4 and all of them (the
  engine's calls hold at most kv/state_cache.py's PROMPT_BATCH_STATE_BYTES of state).
- Denormals: fresh prompts two to a call (as the engine batches them) with each head's decay per token drawn as a
  random-weight model's are (A up to 16, g = -A softplus(...) down to about -11), whose cumulative decays make
  numbers below float32's smallest normal; timed as they are and flushed to zero on every thread as an engine's
  step flushes them (engine/denormals.py), in turn."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.model.gated_delta import chunked_gated_delta_rule, qk_norm_and_scale, recurrent_gated_delta_rule

PRESETS = Path(__file__).resolve().parent.parent / "planner" / "presets"


def layer_shape(preset: str) -> tuple[int, int, int, int]:
    """(linear layers, value heads, key head dim, value head dim) of a preset's Gated DeltaNet layers."""
    hf = json.loads((PRESETS / f"{preset}.json").read_text())
    num_linear = hf["num_hidden_layers"] - hf["num_hidden_layers"] // hf["full_attention_interval"]
    return num_linear, hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]


def inputs(batch: int, tokens: int, heads: int, dk: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = qk_norm_and_scale(torch.randn(batch, tokens, heads, dk, generator=g),
                             torch.randn(batch, tokens, heads, dk, generator=g))
    v = torch.randn(batch, tokens, heads, dv, generator=g)
    decay = -torch.rand(batch, tokens, heads, generator=g) * 0.5
    beta = torch.rand(batch, tokens, heads, generator=g)
    return q, k, v, decay, beta, torch.randn(batch, heads, dv, dk, generator=g) * 0.1  # the state cache's layout


def medians_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Each function's median time, the functions run in turn within each repeat (a slow spell weighs on all)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up
    for _ in range(repeat):
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def cut(args: tuple[torch.Tensor, ...], at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over a prompt cut into two chunks at `at`: outputs and final state."""
    *x, state = args
    first, state = chunked_gated_delta_rule(*(t[:, :at] for t in x), state)
    second, state = chunked_gated_delta_rule(*(t[:, at:] for t in x), state)
    return torch.cat([first, second], dim=1), state


def verification(shape: tuple[int, int, int, int], draft: int, repeat: int) -> None:
    num_linear, heads, dk, dv = shape
    x = inputs(1, 1 + draft, heads, dk, dv)
    accepted = 1 + draft // 2  # a draft half rejected: the state after the last token and half the draft
    slot = torch.zeros(heads, dk, dv)
    state_mib = heads * dk * dv * 4 * num_linear / 2**20
    one = inputs(1, 1, heads, dk, dv)
    ms = medians_ms({
        "chunked": lambda: chunked_gated_delta_rule(*x),
        "rollback": lambda: slot.copy_(chunked_gated_delta_rule(*(t[:, :accepted] for t in x[:5]), x[5])[1][0]),
        "by token": lambda: recurrent_gated_delta_rule(*x),
        "one token": lambda: recurrent_gated_delta_rule(*one),
    }, repeat)
    print(f"verification of 1 + {draft} tokens, one layer ({heads} value heads, {dk}x{dv}):")
    print(f"  chunked form (the engine):              {ms['chunked']:.3f} ms")
    print(f"  its rollback, {accepted} tokens again from the state before: {ms['rollback']:.3f} ms (only when a "
          "draft token was rejected)")
    print(f"  token by token, every state made:      {ms['by token']:.3f} ms")
    print(f"  (a plain decode step's one token:      {ms['one token']:.3f} ms)")
    print(f"  kept per drafted sequence until verified, {num_linear} linear layers: the state before the step "
          f"{state_mib:.1f} MiB; every token's state {(1 + draft) * state_mib:.1f} MiB")


def invariance(shape: tuple[int, int, int, int], prompt: int, repeat: int) -> None:
    _, heads, dk, dv = shape
    x = inputs(1, prompt, heads, dk, dv)
    whole, whole_state = chunked_gated_delta_rule(*x)
    out, state = cut(x, prompt // 3)
    print(f"batch invariance, a {prompt}-token prompt, one layer:")
    print(f"  whole vs cut at {prompt // 3}: outputs {float((whole - out).abs().max()):.2e} apart, "
          f"state {float((whole_state - state).abs().max()):.2e}")
    batch = inputs(8, 1, heads, dk, dv, seed=1)
    together, _ = recurrent_gated_delta_rule(*batch)
    alone = torch.cat([recurrent_gated_delta_rule(*(t[i : i + 1] for t in batch))[0] for i in range(8)])
    print(f"  recurrent decode of 8 sequences vs each alone: {float((together - alone).abs().max()):.2e} apart")
    ms = medians_ms({"chunked": lambda: chunked_gated_delta_rule(*x),
                     "by token": lambda: recurrent_gated_delta_rule(*x)}, max(1, repeat // 4))
    print(f"  chunked form {ms['chunked']:.1f} ms, token by token {ms['by token']:.1f} ms "
          f"({ms['by token'] / ms['chunked']:.1f}x)")


def prompt_batching(shape: tuple[int, int, int, int], sequences: int, tokens: int, repeat: int) -> None:
    _, heads, dk, dv = shape
    x = inputs(sequences, tokens, heads, dk, dv, seed=2)
    sizes = sorted({1, 2, 4, sequences})
    ms = medians_ms({n: (lambda n=n: [chunked_gated_delta_rule(*(t[i : i + n] for t in x))
                                      for i in range(0, sequences, n)]) for n in sizes}, max(1, repeat // 4))
    print(f"prompt batching, {sequences} prompts of {tokens} tokens, one layer ({heads * dk * dv * 4 / 2**20:.1f} MiB "
          "of state per sequence):")
    for n in sizes:
        print(f"  {n:>3} per call: {ms[n]:.1f} ms ({ms[n] / ms[1]:.2f}x one per call)")


def denormals(shape: tuple[int, int, int, int], sequences: int, tokens: int, repeat: int) -> None:
    from kvserve.engine.denormals import describe, flushed_denormals

    _, heads, dk, dv = shape
    q, k, v, _, beta, _ = inputs(sequences, tokens, heads, dk, dv, seed=3)
    strong = -torch.rand(heads, generator=torch.Generator().manual_seed(4)) * 11  # each head's decay per token
    g = strong.expand(sequences, tokens, heads)

    def prompts() -> None:
        for i in range(0, sequences, 2):
            chunked_gated_delta_rule(*(t[i : i + 2] for t in (q, k, v, g, beta)), None)

    def flushed() -> None:
        with flushed_denormals():  # as an engine's step runs
            prompts()

    ms = medians_ms({"kept": prompts, "flushed": flushed}, max(1, repeat // 4))
    print(f"denormals, {sequences} fresh prompts of {tokens} tokens two to a call, strong decays, one layer:")
    print(f"  as they are {ms['kept']:.1f} ms; flushed to zero {ms['flushed']:.1f} ms "
          f"({ms['kept'] / ms['flushed']:.2f}x; {describe()})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.bench.delta_rule", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-next-80b-a3b", help="planner preset (default %(default)s)")
    p.add_argument("--draft", type=int, default=4, help="draft tokens (default %(default)s)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default %(default)s)")
    p.add_argument("--repeat", type=int, default=20, help="timed runs (default %(default)s)")
    p.add_argument("--value-heads", type=int, default=None, help="instead of the preset's (Qwen3.5-0.8B: 16)")
    p.add_argument("--prompts", type=int, default=32, help="prompts batched (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each (default %(default)s)")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    shape = layer_shape(args.preset)
    if args.value_heads is not None:
        shape = (shape[0], args.value_heads, *shape[2:])
    print(f"{args.preset}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    verification(shape, args.draft, args.repeat)
    invariance(shape, args.prompt, args.repeat)
    prompt_batching(shape, args.prompts, args.prompt_tokens, args.repeat)
    denormals(shape, args.prompts, args.prompt_tokens, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
