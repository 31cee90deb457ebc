"""Building an engine, one part at a time: resolve the model and its config, check the settings against each other
and the model, plan the KV cache, then load the model, allocate the cache, open the disk tier, wire the cache
manager, speculator and scheduler, and compile the steps for the runner. A setting is refused before the weights
load; each part's start-up line (engine/startup.py) is logged as soon as that part exists, so the lines come in
the order the parts are built and a slow compile waits behind the lines before it."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.batch_invariant import TILE_ROWS, RowTiles
from kvserve.compile.steps import (WHOLE_GRAPH_KV_BYTES, CompiledSteps, attention_outside, gemms_unused,
                                   unsupported)
from kvserve.config import EngineConfig
from kvserve.engine import denormals, startup
from kvserve.engine.head_build import attach_head_streams, build_head_cache, check_head_settings
from kvserve.engine.head_runner import HeadStreamRunner
from kvserve.engine.heap import keep_freed_heap
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence_factory import SequenceFactory
from kvserve.engine.speculative import Speculator
from kvserve.engine.validation import RequestValidator, longest_token_chars
from kvserve.kv.eviction import AttentionScores, EvictionPolicy, make_policy
from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats.compiled import decode_kind
from kvserve.kv.formats.latent import check_latent_settings
from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.kv.state_cache import StateCache, StateShape
from kvserve.kv.tiers.disk import DiskKVCache
from kvserve.kv.tiers.record import model_fingerprint
from kvserve.kv.tiers.store import DiskBlockStore
from kvserve.model.config import LINEAR_ATTENTION, ModelConfig
from kvserve.model.int8_kernels import FloatKernel
from kvserve.model.linear import WeightsPolicy
from kvserve.model.loader import load_weights, resolve_model
from kvserve.model.registry import MODEL_CLASSES, build_model
from kvserve.planner.capacity import KVCachePlan, plan_kv_cache
from kvserve.planner.kv_size import kv_layout
from kvserve.planner.layout import KVLayout
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.units import format_bytes

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class EngineSetup:
    """What the settings and the model's config decide before anything large is loaded."""

    model_name: str
    model_path: Path
    model_config: ModelConfig
    max_model_len: int
    layout: KVLayout
    eviction: EvictionPolicy
    cache_plan: KVCachePlan


@dataclass(frozen=True)
class EngineParts:
    """A built engine's parts, handed to LLMEngine."""

    setup: EngineSetup
    validator: RequestValidator
    sequence_factory: SequenceFactory
    model: Any  # one of MODEL_CLASSES
    cache: PagedKVCache
    state_cache: StateCache | None  # hybrid models: the linear layers' state slots
    disk_cache: DiskKVCache | None
    kv: KVCacheManager
    scores: AttentionScores | None
    speculator: Speculator | None
    scheduler: Scheduler
    runner: ModelRunner


def build_engine(config: EngineConfig) -> EngineParts:
    """Every part of an engine for `config`, in the order each needs the ones before it."""
    setup = plan_engine(config)
    validator = request_validator(config, setup)
    eos_token_ids = frozenset(setup.model_config.eos_token_ids) | _generation_eos(setup.model_path)
    sequence_factory = SequenceFactory(eos_token_ids, validator.tokenizer)
    if torch.device(config.device).type == "cpu":
        logger.info(keep_freed_heap())  # each step's temporaries live on the C heap
        logger.info(denormals.describe())  # flushed while each step runs (LLMEngine._step)
    eager_decode_reason = eager_steps_reason(config, setup)
    model = load_model(config, setup, eager_decode_reason)
    check_model_windows(setup)
    tiles = RowTiles(TILE_ROWS if config.batch_invariant else None)
    per_head = setup.eviction.per_head  # per-(layer, KV head) streams: their own storage, manager and runner
    cache = build_cache(config, setup, tiles)
    state_cache = build_state_cache(config, setup)
    disk_cache = open_disk_cache(config, setup, cache, state_cache) if config.kv_disk_cache is not None else None
    kv = cache_manager(config, setup, disk_cache, cache.num_blocks)
    if per_head:
        attach_head_streams(kv, cache, model, setup.model_path)
    scores = attention_scores(config, setup)
    speculator = (Speculator(config.speculative_config, cache)
                  if config.speculative_config is not None else None)
    if speculator is not None:
        logger.info(startup.speculation_line(config.speculative_config))
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, speculator)
    compiled = compile_decode_steps(config, model, cache, setup.eviction, eager_decode_reason)
    runner = (HeadStreamRunner if per_head else ModelRunner)(model, cache, kv, config.device, scores, tiles, compiled,
                                                             state_cache)
    return EngineParts(setup, validator, sequence_factory, model, cache, state_cache, disk_cache, kv, scores,
                       speculator, scheduler, runner)


# ---- before anything large is loaded -----------------------------------------------------------------------
def plan_engine(config: EngineConfig) -> EngineSetup:
    """Resolve the model, derive its KV layout and eviction policy, check the settings, and plan the cache."""
    source = resolve_model(config.model)
    hf_config = json.loads((source.path / "config.json").read_text())
    model_config = ModelConfig.from_hf(hf_config)
    max_model_len = resolve_max_model_len(config, model_config)
    spec = ModelSpec.from_hf_config(hf_config, name=source.name)
    layout = kv_layout(spec)
    eviction = make_policy(config.kv_eviction, config.kv_sink_tokens, config.kv_recent_tokens,
                           config.kv_budget_tokens)
    check_settings(config, model_config, layout, eviction)
    cache_plan = plan_kv_cache(
        spec,
        config.kv_cache_memory_bytes,
        config.block_size,
        config.kv_cache_format,
        max_model_len,
        config.kv_eviction,
        eviction.max_blocks(config.block_size),
        state_slots=config.max_num_seqs if model_config.linear is not None else None,
        # prefix caching keeps as many state checkpoints as running slots (the rule the start-up line states)
        state_checkpoints=config.max_num_seqs if config.enable_prefix_caching else 0,
    )
    if not cache_plan.fits:
        raise ValueError(cache_plan.error)
    return EngineSetup(source.name, source.path, model_config, max_model_len, layout, eviction, cache_plan)


def resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """max_model_len, defaulting to the model's positions and never beyond them."""
    limit = mc.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}")
    return config.max_model_len


def check_settings(config: EngineConfig, model_config: ModelConfig, layout: KVLayout,
                   eviction: EvictionPolicy) -> None:
    """Settings that contradict the model or each other, refused before the cache is planned."""
    if eviction.evicts and layout.windows != (None,):
        raise ValueError(f"kv_eviction={config.kv_eviction!r} is not supported with sliding-window models; "
                         "their sliding layers already bound the cache")
    if model_config.deepseek is not None:
        check_latent_settings(config.kv_cache_format, config.kv_eviction)
    if model_config.linear is not None:
        check_hybrid_settings(config, model_config)
    if eviction.per_head:
        check_head_settings(config)
    check_fits_in_memory(config)


# Measured by `python -m kvserve.bench.delta_rule` (docs/architecture.md, "Hybrid models").
HYBRID_NOT_BATCH_INVARIANT = (
    "the linear-attention layers' chunked delta rule rounds a sequence's outputs and state by where its prompt is "
    "cut into chunks, and the scheduler cuts prompts by the step's token budget, which the other requests share "
    "(the form that does not depend on cuts, one token at a time, runs a prompt about 3x slower), and their "
    "per-token work is not cut in fixed tiles")


def check_hybrid_settings(config: EngineConfig, model_config: ModelConfig) -> None:
    """What hybrid models (Gated DeltaNet layers with a state slot per sequence) do not run with yet, by name."""
    if config.batch_invariant:
        raise ValueError(f"batch_invariant is not supported with hybrid models ({model_config.architecture}): "
                         f"{HYBRID_NOT_BATCH_INVARIANT}; turn it off")
    if config.kv_eviction != "none":  # drops KV blocks, while the state keeps every token
        raise ValueError(f"kv_eviction is not supported with hybrid models ({model_config.architecture}: "
                         "linear-attention layers keep a state per sequence); turn it off")


def check_fits_in_memory(config: EngineConfig) -> None:
    """A CPU KV cache larger than the machine's RAM fails late and obscurely (allocator error or OOM kill)."""
    if config.device != "cpu" or "SC_PHYS_PAGES" not in os.sysconf_names:
        return
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if config.kv_cache_memory_bytes > ram_bytes:
        raise ValueError(f"kv_cache_memory={format_bytes(config.kv_cache_memory_bytes)} is more than this machine's "
                         f"memory ({format_bytes(ram_bytes)}); choose a smaller --kv-cache-memory")


def request_validator(config: EngineConfig, setup: EngineSetup) -> RequestValidator:
    """The model's tokenizer and the limits requests are checked against (engine/validation.py)."""
    tokenizer = load_tokenizer(setup.model_path)
    return RequestValidator(tokenizer, setup.max_model_len, setup.model_config.vocab_size, config.max_num_seqs,
                            setup.eviction.unbounded_length, longest_token_chars(tokenizer))


def load_tokenizer(path: Path):
    """The model directory's tokenizer, or None if it has none."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _generation_eos(path: Path) -> frozenset[int]:
    """The end-of-sequence ids generation_config.json adds to the model config's."""
    file = path / "generation_config.json"
    if not file.exists():
        return frozenset()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


# ---- the model and its cache -------------------------------------------------------------------------------
def load_model(config: EngineConfig, setup: EngineSetup, eager_decode_reason: str | None):
    """The model with its weights; under --compile-decode a one-row graph multiplies float weights in loops of
    its own, over dense weights (model/linear.py), and where the steps run eagerly all the same, one row is
    multiplied by that loop compiled on its own (OneRowLoop, compiled or loaded here)."""
    mc = setup.model_config
    weights = load_weights(setup.model_path, config.torch_dtype)
    eager_one_row = (eager_decode_reason is not None and config.compile.decode_steps and not config.batch_invariant
                     and torch.device(config.device).type == "cpu")
    policy = WeightsPolicy(config.torch_dtype, config.device, config.quantization, config.batch_invariant,
                           dense_in_graph=eager_decode_reason is None, eager_one_row=eager_one_row)
    model = build_model(mc, weights, setup.max_model_len, policy)
    logger.info(startup.weights_line(weights_facts(config, model)))
    one_row = model.linears.one_row
    if one_row is not None:
        started = time.perf_counter()
        one_row.warm_up(config.torch_dtype, config.device)
        logger.info(startup.one_row_loop_line(time.perf_counter() - started, one_row))
    return model


def check_model_windows(setup: EngineSetup) -> None:
    """The model's sliding-window layers are the ones the planner's KV layout gives a window."""
    mc = setup.model_config
    model_windows = [mc.sliding_window if t == "sliding_attention" else None
                     for t in mc.layer_types if t != LINEAR_ATTENTION]  # linear layers keep no KV
    if model_windows != [setup.layout.windows[g] for g in setup.layout.group_of]:
        raise ValueError(f"{setup.model_name}: the model's sliding-window layers {model_windows} disagree with "
                         "the KV layout the planner derived from its config")


def weights_facts(config: EngineConfig, model) -> startup.WeightsFacts:
    """What the built model holds: its bytes, its form and the copies its kernels keep."""
    linears = model.linears
    fallback = linears.kernel.reason if isinstance(linears.kernel, FloatKernel) else None
    kernel = linears.kernel or linears.matmul  # what multiplies the weights: int8's kernel, or the float one
    return startup.WeightsFacts(model.weights_nbytes, config.dtype, config.quantization, fallback,
                                linears.tied_copy_nbytes, linears.dense_copy_nbytes, kernel.name)


def build_cache(config: EngineConfig, setup: EngineSetup, tiles: RowTiles) -> PagedKVCache:
    """The KV cache the planner sized, allocated and warmed up (its decode attention compiled, where it is)."""
    mc, plan, layout = setup.model_config, setup.cache_plan, setup.layout
    if setup.eviction.per_head:
        cache = build_head_cache(config, plan, layout, mc)
        logger.info(startup.capacity_line(cache_facts(plan, cache, layout, config.max_num_seqs)))
        logger.info(startup.batch_invariance_line(False, config.block_size, config.kv_eviction))
        return cache
    # batch-invariant attention reads every format the same way for every query (no compiled decode)
    cache = make_kv_cache(KVCacheSpec(config.kv_cache_format, layout, plan.num_blocks, plan.block_size,
                                      mc.num_kv_heads, mc.head_dim, config.torch_dtype, config.device,
                                      config.max_num_seqs, compile=not (config.enforce_eager or config.batch_invariant),
                                      tiles=tiles, decode_in_place=config.compile.decode_steps,
                                      latent_rope_dim=mc.deepseek.qk_rope_head_dim if mc.deepseek else None))
    started = time.perf_counter()
    cache.warm_up(mc.num_heads)
    compile_seconds = time.perf_counter() - started
    logger.info(startup.capacity_line(cache_facts(plan, cache, layout, config.max_num_seqs)))
    chunked = config.kv_eviction if setup.eviction.needs_attention_scores else None  # H2O
    logger.info(startup.batch_invariance_line(config.batch_invariant, config.block_size, chunked))
    kernels = {name: k for name, k in cache.compiled_kernels().items() if decode_kind(k) == "compiled"}
    if "decode attention" in kernels:
        logger.info(startup.compiled_attention_line(startup.CompiledAttentionFacts(
            cache.format_name, compile_seconds, sum(k.graphs_loaded for k in kernels.values()),
            sum(k.graphs_compiled for k in kernels.values()), tuple(kernels))))
    return cache


def build_state_cache(config: EngineConfig, setup: EngineSetup) -> StateCache | None:
    """A hybrid model's state slots and checkpoints, as many as the plan carved out of the budget."""
    lc, plan = setup.model_config.linear, setup.cache_plan.state
    if lc is None:
        return None
    shape = StateShape(plan.num_linear_layers, lc.conv_dim, lc.conv_kernel - 1, lc.num_value_heads,
                       lc.key_head_dim, lc.value_head_dim)
    # the decode update compiled as the decode steps are (not in batch-invariant mode, which compiles nothing)
    cache = StateCache(shape, plan.num_slots + plan.num_checkpoints, config.device,
                       compile_update=config.compile.decode_steps and not config.batch_invariant)
    started = time.perf_counter()
    cache.warm_up()
    if cache.compiled_update is not None:
        logger.info(startup.compiled_state_update_line(cache.update_kind(), time.perf_counter() - started,
                                                       cache.compiled_update))
    return cache


def cache_facts(plan: KVCachePlan, cache: PagedKVCache, layout: KVLayout, max_num_seqs: int) -> startup.CacheFacts:
    """The cache as it describes itself now (its decode attention may have fallen back to eager since start)."""
    return startup.CacheFacts(plan, cache.describe(), layout.describe(), cache.extra_nbytes, max_num_seqs)


def open_disk_cache(config: EngineConfig, setup: EngineSetup, cache: PagedKVCache,
                    state_cache: StateCache | None = None) -> DiskKVCache:
    """The disk tier, its records named for everything that decides a block's bytes (kv/tiers/); a hybrid model's
    state checkpoints are kept there too."""
    # a hybrid's checkpoints are stored as its slots hold them
    states = {"state_layout": state_cache.shape.describe()} if state_cache is not None else {}
    fingerprint = model_fingerprint(
        setup.model_path, kv_cache_format=config.kv_cache_format, block_specs=cache.block_specs(),
        block_size=config.block_size, dtype=config.dtype, quantization=config.quantization,
        layout=setup.layout, batch_invariant=config.batch_invariant, device=torch.device(config.device).type,
        **states)
    store = DiskBlockStore(config.kv_disk_cache, config.kv_disk_cache_size_bytes, fingerprint)
    logger.info(store.start_line(config.block_size, setup.layout.num_groups))
    return DiskKVCache(store, cache, state_cache)


def cache_manager(config: EngineConfig, setup: EngineSetup, disk_cache: DiskKVCache | None,
                  num_blocks: int) -> KVCacheManager:
    """Block tables, prefix index and eviction over the storage's `num_blocks` (the plan's, or its head blocks),
    reading prefixes from the disk tier if any."""
    plan, eviction, layout = setup.cache_plan, setup.eviction, setup.layout
    state = plan.state
    return KVCacheManager(num_blocks, plan.block_size, config.enable_prefix_caching,
                          hash_namespace=config.kv_cache_format, eviction=eviction,
                          windows=layout.windows, tile_windows=config.batch_invariant, disk=disk_cache,
                          state_slots=state.num_slots if state is not None else None,
                          state_checkpoints=state.num_checkpoints if state is not None else 0)


def attention_scores(config: EngineConfig, setup: EngineSetup) -> AttentionScores | None:
    """Accumulated attention per cached token, for an eviction policy that drops the least attended (H2O)."""
    plan = setup.cache_plan
    return (AttentionScores(plan.num_blocks * plan.block_size, plan.block_size, config.device)
            if setup.eviction.needs_attention_scores else None)


# ---- compiled steps ----------------------------------------------------------------------------------------
def eager_steps_reason(config: EngineConfig, setup: EngineSetup) -> str | None:
    """Why this engine's decode steps run eagerly (None: they run compiled): turned off, or no graph supports the
    model or its settings. Asked before the model is built: only then does it keep the dense weights the graph's
    one-row loops read (model/linear.py)."""
    if not config.compile.decode_steps:
        return config.compile.eager_reason
    if setup.eviction.per_head:  # asked for explicitly, head_build refuses it
        return f"kv_eviction={config.kv_eviction!r} reads per-head KV streams eagerly"
    return unsupported(MODEL_CLASSES[setup.model_config.architecture], config.batch_invariant,
                       setup.eviction.unbounded_length)


def compile_decode_steps(config: EngineConfig, model, cache: PagedKVCache, eviction: EvictionPolicy,
                         eager_decode_reason: str | None) -> CompiledSteps | None:
    """Decode steps as compiled graphs, compiled or loaded now (compile/steps.py); None: they run eagerly."""
    if eager_decode_reason is not None:
        logger.info(startup.eager_steps_line(eager_decode_reason))
        return None
    outside = attention_outside(cache, eviction.needs_attention_scores)
    gemms = config.compile_gemms
    if gemms and (unused := outside or gemms_unused(model)) is not None:
        logger.info(startup.gemms_not_applied_line(unused))
        gemms = False
    compiled = CompiledSteps(model, cache, gemms=gemms, whole=outside is None)
    logger.info(startup.compiling_steps_line(compiled.pending()))
    if not compiled.warm_up():
        return None
    facts = startup.CompiledStepsFacts(outside, WHOLE_GRAPH_KV_BYTES, compiled.compile_seconds,
                                       compiled.compile_phases_line(), compiled.gemms_line())
    logger.info(startup.compiled_steps_line(facts))
    return compiled
