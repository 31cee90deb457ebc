"""`kvserve generate` and `kvserve chat`, plus the engine options every subcommand that runs a model shares."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from kvserve.config import DTYPES, KV_EVICTION_POLICIES, QUANTIZATIONS, EngineConfig
from kvserve.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field, same names with dashes; `exclude` names fields the caller defines itself."""
    defaults = EngineConfig()
    g = _FlagsExcept(parser.add_argument_group("engine"), exclude)
    _add_weights_flags(g, defaults)
    _add_cache_flags(g, defaults)
    _add_eviction_flags(g, defaults)
    g.add_argument("--seed", type=int, default=defaults.seed)
    g.add_argument("--device", default=defaults.device)
    _add_compile_flags(g)
    _add_tier_flags(g, defaults)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding without a draft model, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or '
                        '\'{"method": "suffix", ...}\' (vLLM\'s names; docs/speculative.md; default: off)')


class _FlagsExcept:
    """An argument group that skips the excluded fields, so each flag is written once below."""

    def __init__(self, group: argparse._ArgumentGroup, exclude: tuple[str, ...]):
        self.group = group
        self.exclude = exclude

    def add_argument(self, flag: str, *args, **kwargs) -> None:
        dest = kwargs.get("dest", flag.removeprefix("--").replace("-", "_"))
        if dest not in self.exclude:
            self.group.add_argument(flag, *args, **kwargs)


def _add_weights_flags(g: _FlagsExcept, defaults: EngineConfig) -> None:
    g.add_argument("--model", default=None, help="preset name, HF model directory or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=defaults.dtype, choices=DTYPES)
    g.add_argument("--quantization", default=defaults.quantization, choices=QUANTIZATIONS,
                   help="weights: none (the --dtype) or int8 (per-output-channel scales, activations quantized per "
                        "token) (default %(default)s)")


def _add_cache_flags(g: _FlagsExcept, defaults: EngineConfig) -> None:
    """The cache's and the scheduler's (CacheConfig, SchedulerConfig), in the order --help has always listed them."""
    g.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype,
                   help="KV storage: auto (the model dtype), float32, bfloat16, float16, fp8 (= fp8_e4m3), fp8_e5m2, "
                        "int8, int4, nuq4, nuq3, nuq3k4v (3-bit keys, 4-bit values) "
                        "(default %(default)s)")
    g.add_argument("--block-size", type=int, default=defaults.block_size)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB (default 1GiB)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")


def _add_eviction_flags(g: _FlagsExcept, defaults: EngineConfig) -> None:
    g.add_argument("--kv-eviction", default=defaults.kv_eviction, choices=KV_EVICTION_POLICIES,
                   help="drop KV blocks a sequence no longer needs: StreamingLLM sinks + window, or H2O heavy hitters")
    g.add_argument("--kv-sink-tokens", type=int, default=defaults.kv_sink_tokens,
                   help="streaming/h2o: first tokens always kept (default %(default)s)")
    g.add_argument("--kv-recent-tokens", type=int, default=defaults.kv_recent_tokens,
                   help="streaming/h2o: window of last tokens kept (default %(default)s)")
    g.add_argument("--kv-budget-tokens", type=int, default=defaults.kv_budget_tokens,
                   help="h2o: tokens kept in all (default %(default)s)")


def _add_compile_flags(g: _FlagsExcept) -> None:
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile with torch.compile: decode steps run eagerly, and so does decode attention over "
                        "an int8, int4 or nuq (nuq4, nuq3, nuq3k4v) KV cache (plain PyTorch ops, slower)")
    g.add_argument("--compile-gemms", action="store_true",
                   help="with compiled decode steps: freeze the weights into the decode graph and multiply them with "
                        "Inductor's C++ GEMM template over its own packed copy (faster decode; more memory; every "
                        "start compiles again: docs/benchmarks.md)")
    g.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps as graphs compiled by torch.compile at start (default: on wherever the model "
                        "family and settings allow, said at start; a first start compiles for tens of seconds and "
                        "saves the graphs, later ones load them; float weights packed for oneDNN are kept dense too, "
                        "for the single stream's one-row loops: more memory, said at start; docs/benchmarks.md). "
                        "--no-compile-decode runs them eagerly and still compiles a KV format's decode attention")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's logits bitwise independent of its batch, chunking, prefix hits and preemption "
                        "(fixed token tiles, attention per query tile; costs speed: docs/benchmarks.md)")


def _add_tier_flags(g: _FlagsExcept, defaults: EngineConfig) -> None:
    g.add_argument("--kv-disk-cache", default=None, metavar="DIR",
                   help="also keep full prefix blocks as files in DIR, read back after the pool evicted them or the "
                        "process restarted (docs/prefix_caching.md; default: off)")
    g.add_argument("--kv-disk-cache-size", default=defaults.kv_disk_cache_size, metavar="SIZE",
                   help="cap of --kv-disk-cache, e.g. 20GiB; least recently used blocks go first (default %(default)s)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="complete a prompt, streaming tokens to the terminal")
    gen.add_argument("prompt", nargs="+", help="prompt text (several words are joined)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run_generate)
    chat = subparsers.add_parser("chat", help="interactive multi-turn chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run_chat)


def _stream(engine, request_id: str, prompt, params: SamplingParams) -> str:
    """Run one request, printing text as it becomes final; returns the whole text."""
    engine.add_request(request_id, prompt, params)
    shown = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return shown


def _load(args: argparse.Namespace, command: str):
    """The LLM the flags ask for, or None after printing why it cannot start (no traceback for a bad flag)."""
    from kvserve.engine.llm import LLM

    try:
        return LLM(**dataclasses.asdict(engine_config_from_args(args)))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve {command}: {exc}", file=sys.stderr)
        return None


def run_generate(args: argparse.Namespace) -> int:
    llm = _load(args, "generate")
    if llm is None:
        return 1
    _stream(llm.engine, "generate", " ".join(args.prompt), sampling_params_from_args(args))
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = _load(args, "chat")
    if llm is None:
        return 1
    params = sampling_params_from_args(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    for turn in range(1_000_000):
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        prompt = {"prompt": llm.apply_chat_template(messages), "add_special_tokens": False}  # the template has its BOS
        reply = _stream(llm.engine, f"chat-{turn}", prompt, params)
        messages.append({"role": "assistant", "content": reply})
        stats = llm.stats()
        print(f"[prefix cache: {stats['prefix_cache_hits']:,} of {stats['prefix_cache_queries']:,} prompt tokens "
              f"reused so far]", file=sys.stderr)
    return 0
