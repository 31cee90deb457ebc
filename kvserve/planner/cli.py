"""`kvserve plan`: how much KV cache a model needs, and how much of it a GPU holds."""
from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from kvserve.planner.capacity import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_OVERHEAD_BYTES,
    MemoryBudget,
    StatePlan,
    plan_kv_cache,
    plan_state,
    resolve_max_model_len,
)
from kvserve.planner.conversation import plan_conversation
from kvserve.planner.gpus import GPU_MEMORY_GIB, gpu_memory_bytes
from kvserve.planner.kv_size import (
    HEAD_STREAM_POLICIES,
    KV_DTYPE_CHOICES,
    KV_DTYPES,
    KV_SCALES_CHOICES,
    PER_TOKEN_HEAD_SCALES,
    eviction_kv_dtype,
    eviction_max_blocks,
    resolve_kv_dtype,
    takes_kv_scales,
)
from kvserve.planner.loaders import load_model_spec, preset_names
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.report import PlanReport, render_report, report_to_json
from kvserve.planner.units import GiB, format_bytes, parse_memory_size
from kvserve.planner.weights import WEIGHT_BITS, weights_bytes

DEFAULT_CONTEXTS = (2_048, 8_192, 32_768, 131_072)
PLOT_KV_DTYPES = ("bf16", "fp8", "int8", "int4")  # compared with the planned one in --plot
PLOT_POINTS = 40

_DESCRIPTION = """\
Plan a model's KV cache: bytes per token, size per request, what fits on a GPU, and the cost of a
multi-turn conversation.

KV bytes/token = 2 (K, V) x layers x KV heads x head_dim x bytes/element (MLA: layers x (kv_lora_rank
+ qk_rope_head_dim) x bytes). With a GPU: KV budget = memory x utilization - weights - overhead, cut
into blocks of --block-size tokens. The default overhead (1.5 GiB) estimates the CUDA context,
workspaces, activations and CUDA graphs; it puts Llama 3.1 8B on a 24 GiB card at ~42K tokens.
Exit status 1 when one request of max_model_len does not fit.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `kvserve plan` on the top-level parser."""
    parser = subparsers.add_parser(
        "plan", help="KV cache capacity planner", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL",
                        help=f"preset ({', '.join(preset_names())}), HF config.json, model directory or GGUF file")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", metavar="NAME", help=f"a known GPU: {', '.join(GPU_MEMORY_GIB)}")
    gpu.add_argument("--gpu-memory", metavar="SIZE", help="GPU memory, e.g. 24GiB, 80GB (a bare number is GiB)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        metavar="FRACTION", help="share of GPU memory the engine may use (default %(default)s)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPE_CHOICES, metavar="DTYPE",
                        help=f"KV element type: {', '.join(KV_DTYPE_CHOICES)}; auto follows the model's "
                             "torch_dtype (default %(default)s)")
    parser.add_argument("--kv-scales", default=PER_TOKEN_HEAD_SCALES, choices=KV_SCALES_CHOICES,
                        help="where fp8, fp8_e5m2 and int8 keep their scales: per-token-head, one fp16 scale per token "
                             "and head vector (kvserve's storage, default), or per-tensor, one per layer and no bytes "
                             "per token (vLLM's FP8 KV cache: exactly half of bf16)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="N",
                        help="tokens per KV block (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="longest request (default: the model's maximum)")
    parser.add_argument("--context", type=int, nargs="+", metavar="N",
                        help="request lengths to size (default 2,048 / 8,192 / 32,768 / 131,072 and the maximum)")
    parser.add_argument("--weights-dtype", default="auto", choices=("auto", *WEIGHT_BITS), metavar="DTYPE",
                        help=f"weights type: auto, {', '.join(WEIGHT_BITS)}; auto is the config's torch_dtype, "
                             "or a GGUF file's own size")
    parser.add_argument("--weights-gib", type=float, metavar="GIB", help="weights size instead of an estimate")
    parser.add_argument("--overhead-gib", type=float, default=DEFAULT_OVERHEAD_BYTES / GiB, metavar="GIB",
                        help="memory for runtime and activations, neither weights nor KV (default %(default)s)")
    evict = parser.add_argument_group("KV eviction (bounds what one request holds at any length)")
    evict.add_argument("--kv-eviction", default="none", choices=("none", "streaming", "h2o", *HEAD_STREAM_POLICIES),
                       help="streaming: StreamingLLM sinks + recent window; h2o: heavy hitters within a budget; "
                       "adakv (adakv-layers, adakv-keydiff, adakv-knorm, perhead, perhead-mix, perhead-span, "
                       "perhead-observed, perhead-observed-span, headkv-span, headkv-observed-span): each "
                       "(layer, KV head) keeps its own tokens, budget tokens per head on average, in blocks of one "
                       "layer's one KV head")
    evict.add_argument("--kv-sink-tokens", type=int, default=4, metavar="N", help="sinks kept (%(default)s)")
    evict.add_argument("--kv-recent-tokens", type=int, default=1024, metavar="N",
                       help="recent window kept (%(default)s)")
    evict.add_argument("--kv-budget-tokens", type=int, default=2048, metavar="N",
                       help="h2o: tokens kept in all; adakv: per KV head (%(default)s)")
    hybrid = parser.add_argument_group("hybrid models (linear-attention layers keep a state slot per sequence)")
    hybrid.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                        help="sequences at once: the engine takes a state slot for each out of the KV budget before "
                             "its blocks (default %(default)s, the engine's)")
    hybrid.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="plan without the state checkpoints prefix caching keeps (as many as --max-num-seqs)")
    parser.add_argument("--kv-disk-cache-size", metavar="SIZE",
                        help="also show what a disk tier of this size holds (--kv-disk-cache), e.g. 100GiB")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of tables")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the GPU memory split and the maximum concurrency against context length for "
                             "each KV dtype into PATH (.png or .svg); needs --gpu or --gpu-memory")
    talk = parser.add_argument_group("conversation mode (stateless chat API, one request per turn)")
    talk.add_argument("--conversation", action="store_true", help="plan a multi-turn conversation")
    talk.add_argument("--first", type=int, default=1200, metavar="N",
                      help="system prompt + first question tokens (%(default)s)")
    talk.add_argument("--question", type=int, default=200, metavar="N",
                      help="tokens of each later question (%(default)s)")
    talk.add_argument("--answer", type=int, default=500, metavar="N", help="tokens of each answer (%(default)s)")
    talk.add_argument("--turns", type=int, default=10, metavar="N", help="number of turns (%(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan; 2 on bad input, 1 when the model does not fit, else 0."""
    try:
        if args.plot:
            _check_plot_args(args)
        report = build_report(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_to_json(report), indent=2))
    else:
        render_report(report, Console(width=None if sys.stdout.isatty() else 120))
    if args.plot:
        try:
            print(f"plot written to {_write_plot(report, args.plot, args.kv_scales)}", file=sys.stderr)
        except ValueError as exc:
            print(f"kvserve plan: error: {exc}", file=sys.stderr)
            return 2
    return 1 if report.error else 0


def _check_plot_args(args: argparse.Namespace) -> None:
    from kvserve.plots import check_plot_path

    check_plot_path(args.plot)
    if not (args.gpu or args.gpu_memory):
        raise ValueError("--plot draws the GPU memory split and what fits in it: give --gpu or --gpu-memory")


def _write_plot(report: PlanReport, path: str, kv_scales: str):
    """The memory split and, per KV dtype, requests that fit against context length; `kv_scales` applies to the
    formats it can (fp8, int8)."""
    from kvserve.plots import plot_plan

    budget, spec = report.budget, report.spec
    split = [("weights", budget.weights_bytes), ("other", budget.overhead_bytes),
             ("KV cache", budget.kv_budget_bytes), ("unused", budget.gpu_memory_bytes - budget.usable_bytes)]
    contexts = _context_grid(spec.max_position_embeddings)
    curves, drawn = {}, set()
    dtypes = () if budget.error else (report.kv_dtype.name, *PLOT_KV_DTYPES)  # no KV memory: nothing fits
    for dtype in dtypes:
        scales = kv_scales if takes_kv_scales(KV_DTYPES[dtype]) else PER_TOKEN_HEAD_SCALES
        plan = plan_kv_cache(spec, budget.kv_budget_bytes, report.block_size, dtype, report.max_model_len,
                             kv_scales=scales, **_state_args(report.state))
        if plan.kv_dtype.name not in drawn:  # the planned dtype is one of PLOT_KV_DTYPES, or an alias of one
            drawn.add(plan.kv_dtype.name)
            name = plan.kv_dtype.name + (f" {scales}" if scales != PER_TOKEN_HEAD_SCALES else "")
            curves[f"{name}, {format_bytes(plan.kv_bytes_per_token)}/token"] = [
                (tokens, plan.concurrency(tokens)) for tokens in contexts]
    title = (f"{spec.name} on {report.gpu_name} ({format_bytes(budget.gpu_memory_bytes)}, "
             f"{budget.gpu_memory_utilization:.0%} usable)")
    return plot_plan(path, title, split, curves, report.max_model_len)


def _context_grid(max_tokens: int) -> list[int]:
    """PLOT_POINTS request lengths spaced evenly on a log scale from 256 (or less) to `max_tokens`."""
    start = min(256, max_tokens)
    ratio = (max_tokens / start) ** (1 / (PLOT_POINTS - 1))
    return sorted({round(start * ratio**i) for i in range(PLOT_POINTS)})


def build_report(args: argparse.Namespace) -> PlanReport:
    """Turn the parsed flags into a PlanReport, validating them on the way."""
    if args.block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {args.block_size}")
    spec = load_model_spec(args.model)
    kv_dtype = eviction_kv_dtype(args.kv_eviction, resolve_kv_dtype(args.kv_cache_dtype, spec, args.kv_scales))
    max_model_len = resolve_max_model_len(spec, args.max_model_len)
    if min(args.kv_sink_tokens, args.kv_recent_tokens, args.kv_budget_tokens) < 0:
        raise ValueError("--kv-sink-tokens, --kv-recent-tokens and --kv-budget-tokens must not be negative")
    max_blocks = eviction_max_blocks(args.kv_eviction, args.kv_sink_tokens, args.kv_recent_tokens,
                                     args.kv_budget_tokens, args.block_size)
    state = _state(spec, args)
    gpu_bytes = _gpu_memory_bytes(args)
    weights, weights_source = _weights(spec, args, needed=gpu_bytes is not None)
    budget = kv_plan = None
    if gpu_bytes is not None:
        if args.overhead_gib < 0:
            raise ValueError(f"--overhead-gib must not be negative, got {args.overhead_gib}")
        budget = MemoryBudget(gpu_bytes, args.gpu_memory_utilization, weights, round(args.overhead_gib * GiB))
        kv_plan = plan_kv_cache(spec, budget.kv_budget_bytes, args.block_size, kv_dtype.name, max_model_len,
                                args.kv_eviction, max_blocks, args.kv_scales, **_state_args(state))
    conversation = None
    if args.conversation:
        conversation = plan_conversation(spec, kv_dtype, args.first, args.question, args.answer,
                                         args.turns, args.block_size)
    return PlanReport(
        spec=spec, kv_dtype=kv_dtype, block_size=args.block_size, max_model_len=max_model_len,
        contexts=_contexts(spec, args.context), weights_bytes=weights, weights_source=weights_source,
        gpu_name=args.gpu or args.gpu_memory, budget=budget, kv_plan=kv_plan, conversation=conversation,
        max_blocks_per_request=max_blocks, kv_eviction=args.kv_eviction, state=state,
        disk_cache_bytes=parse_memory_size(args.kv_disk_cache_size) if args.kv_disk_cache_size else None,
    )


def _state(spec: ModelSpec, args: argparse.Namespace) -> StatePlan | None:
    """The state slots the engine would take for this model (None unless it has linear layers of known size)."""
    if args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be at least 1, got {args.max_num_seqs}")
    checkpoints = args.max_num_seqs if args.enable_prefix_caching else 0
    return plan_state(spec, args.max_num_seqs, checkpoints)


def _state_args(state: StatePlan | None) -> dict:
    """plan_kv_cache's keyword arguments for these state slots (none for a model without them)."""
    if state is None:
        return {}
    return {"state_slots": state.num_slots, "state_checkpoints": state.num_checkpoints}


def _gpu_memory_bytes(args: argparse.Namespace) -> int | None:
    if args.gpu:
        return gpu_memory_bytes(args.gpu)
    return parse_memory_size(args.gpu_memory) if args.gpu_memory else None


def _weights(spec: ModelSpec, args: argparse.Namespace, needed: bool) -> tuple[int | None, str]:
    """Weights bytes and where the number comes from; None when unknown and no GPU asks for it."""
    if args.weights_gib is not None:
        if args.weights_gib < 0:
            raise ValueError(f"--weights-gib must not be negative, got {args.weights_gib}")
        return round(args.weights_gib * GiB), "--weights-gib"
    if spec.num_parameters is None and spec.weights_bytes is None and not needed:
        return None, "parameter count not in the config"
    size = weights_bytes(spec, args.weights_dtype)
    if args.weights_dtype == "auto" and spec.weights_bytes is not None:
        return size, "tensor sizes in the file"
    dtype = spec.torch_dtype if args.weights_dtype == "auto" else args.weights_dtype
    return size, f"{spec.num_parameters / 1e9:.2f}B params × {WEIGHT_BITS[dtype]:g} bits ({dtype})"


def _contexts(spec: ModelSpec, requested: list[int] | None) -> tuple[int, ...]:
    if requested:
        if min(requested) < 1:
            raise ValueError(f"--context lengths must be at least 1, got {min(requested)}")
        return tuple(requested)
    maximum = spec.max_position_embeddings
    return tuple(sorted({*(c for c in DEFAULT_CONTEXTS if c < maximum), maximum}))
