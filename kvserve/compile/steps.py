"""Compiled steps: the model's forward pass traced by `torch.compile` (Inductor) once at engine start, so that a step
runs a few fused kernels instead of every layer's eager ops dispatched one by one from Python. Two graphs: the whole
graph (attention inside; a single stream, and a few sequences whose padded K/V stays under WHOLE_GRAPH_KV_BYTES)
and the graph with attention outside (attention one custom op over the step's real metadata; every other step,
prompt chunks included). Both are compiled, or loaded whole (kvserve/saved_graphs.py), at start, and nothing compiles
while serving: a step no graph takes runs eagerly. `unsupported` names the engines no graph covers and
`attention_outside` those whose attention stays outside at every step. docs/architecture.md ("Compiled steps") gives
the long explanation (layer regions, the one-row loops, --compile-gemms, rounding); docs/benchmarks.md
(`kvserve bench step`, `kvserve bench throughput --compile-decode`) the measurements."""
from __future__ import annotations

import logging
import time
import types
import weakref
from dataclasses import dataclass, replace

import torch

from kvserve.compile.graph_cache import CompileTimes, engine_objects
from kvserve.compile.inductor import (COMPILE_PHASES, freezing, phase_seconds, quiet_autotuning, resident_bytes,
                                      step_guards)
from kvserve.compile.shapes import at_least_two_blocks, mark_dynamic, mark_sequences, two_rows
from kvserve.inductor_isa import remember_vec_isa_probe
from kvserve.kv.kv_cache import FullPrecisionKVCache, PagedKVCache
from kvserve.model.attention import (AttentionGroup, AttentionMetadata, LayerRegion, attend_over,
                                     attention_outside_graph)
from kvserve.model.gemma3 import Gemma3Model
from kvserve.model.float_kernels import BLAS
from kvserve.model.int8_kernels import FloatKernel
from kvserve.model.linear import GRAPH_MATRIX_VECTOR_DTYPES, Int8Linear, Linear
from kvserve.model.llama import LlamaModel
from kvserve.saved_graphs import GraphKey, GraphMiss, GraphSet, first_line

logger = logging.getLogger("kvserve")

# --compile-gemms: the weights frozen into the graph as constants, and each matmul by Inductor's C++ GEMM template
# over its own packed copy where Inductor's benchmark at compile time finds it faster than the ATen (BLAS) call
GEMM_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                "max_autotune_report_choices_stats": False}
# Inductor's generated wrapper checks every input's sizes and strides (and alignment, and scalar ranges) at every
# call: some 1,100 checks a single-stream step of SmolLM2, 26 in each of its 30 layer regions' calls. Dynamo's guards
# check the step's own inputs already, and the weights and the pool never change shape (docs/benchmarks.md,
# "Inductor's per-call checks").
STEP_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
WARM_UP_BLOCKS = 3  # block-table width of the start-up batches (any width > 1 compiles the same dynamic graph)
# Several sequences whose decodes are one attention call per layer group run the whole graph (attention inside it,
# each request's blocks gathered and padded to the widest) while that reads at most this many bytes of K/V a step
# (padded keys, every layer); past it, the graph with attention outside, whose float32 kernel reads each request's
# own blocks in place. The bound is where `kvserve bench step` found the whole graph stop being the faster one:
# 8,192 padded keys of SmolLM2's 45 KiB of K/V a token (docs/benchmarks.md).
WHOLE_GRAPH_KV_BYTES = 360 * 2**20


def padded_kv_bytes(cache: PagedKVCache, meta: AttentionMetadata) -> float:
    """The K/V a step of one attention call per layer group reads in the whole graph, each request's blocks gathered
    and padded to the widest: every layer group's block table, a slot of which holds its group's layers."""
    slot_bytes = cache.nbytes / max(cache.num_blocks * cache.block_size, 1)
    return sum(groups[0].block_tables.numel() for groups in meta.groups) * cache.block_size * slot_bytes


def zero_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """Attention that writes nothing and returns zeros: the warm-up's (its steps must leave the pool as it was), and
    `kvserve bench step`'s graph without attention."""
    return torch.zeros_like(q)


def unsupported(model_class: type, batch_invariant: bool, unbounded_positions: bool) -> str | None:
    """Why no decode step of an engine of this model class can run compiled (None: decode steps can). Asked before
    the model is built: only then does it keep the dense weights the graph's one-row loops read (model/linear.py)."""
    if not issubclass(model_class, (LlamaModel, Gemma3Model)):
        return f"{model_class.__name__} is not compiled (Llama and Gemma 3 families only)"
    if batch_invariant:
        return "--batch-invariant runs fixed tiles eagerly"
    if unbounded_positions:
        return "a streaming sequence's positions outgrow the RoPE table, computed eagerly"
    return None


def attention_outside(cache: PagedKVCache, needs_scores: bool) -> str | None:
    """Why this engine's attention stays outside the graph at every decode step, a single stream's included (None:
    the whole graph runs the steps it fits). Attention outside runs eagerly, as it does without a graph."""
    if not isinstance(cache, FullPrecisionKVCache):  # float32's kernel in place serves the eager steps alone
        if cache.fused_decode is not None or cache.exact_own_block:
            return f"the {cache.format_name} KV cache attends with its own compiled decode kernel"
        return f"the {cache.format_name} KV cache attends eagerly (float32, bfloat16 and float16 inside the graph)"
    if needs_scores:
        return "H2O's attention scores are computed eagerly"
    return None


def gemms_unused(model) -> str | None:
    """Why --compile-gemms would add nothing but its costs to this model's graph (None: it applies). Inductor's GEMM
    template multiplies float weights that F.linear multiplies, and int8 ones that oneDNN's quantized linear multiplies
    (it lowers that op over frozen weights, with int8 micro-kernels of its own); torch._int_mm's calls stay its
    calls, and freezing them made the step slower (docs/benchmarks.md), and so do calls of oneDNN's float linear over
    its packed weights (model/float_kernels.py)."""
    kernel = model.linears.kernel
    if kernel is not None and not isinstance(kernel, FloatKernel) and not kernel.inductor_template:
        return f"the int8 weights are multiplied by {kernel.name}, which Inductor's GEMM template does not replace"
    if model.linears.matmul is not BLAS:
        return (f"the weights are multiplied by {model.linears.matmul.name}, which Inductor's GEMM template does not "
                "replace")
    return None


def layer_regions(model, cache: PagedKVCache, gemms: bool) -> list[LayerRegion] | None:
    """The layers of a compiled graph as one nested compile region (model/attention.py's LayerRegion), for the Llama
    and Gemma 3 families: Dynamo traces one layer instead of each and Inductor compiles its code once, so a graph
    compiles in a fraction of the time (docs/benchmarks.md). A model's forward must not read a layer object before
    handing it to run_layer: Dynamo then knows that layer by the model's path, and reused the region for every layer
    with the first one's weights (Gemma 3 did, reading layer.layer_type; tests/compile/test_steps.py's Gemma cases
    fail so). None (each layer traced as its own code): --compile-gemms, whose freezing Dynamo does not apply
    through a region (it fails tracing: "Freevar has no source")."""
    if gemms or not isinstance(model, (LlamaModel, Gemma3Model)):
        return None
    return [LayerRegion(layer, i, cache) for i, layer in enumerate(model.layers)]


def _decode_forward(input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
    """The model's forward pass; each engine runs a copy whose globals reach its model (CompiledSteps)."""
    return _raw_forward(_engine.model, input_ids, meta, cache)  # noqa: F821 - the copy's globals


def _decode_logits(hidden: torch.Tensor) -> torch.Tensor:
    """The model's output head over one row; as _decode_forward, each engine runs a copy of its own."""
    return _raw_logits(_engine.model, hidden)  # noqa: F821 - the copy's globals


def head_in_graph(model) -> bool:
    """Whether one row's logits run compiled: an output head of dense float weights (with a packed copy too under
    --compile-decode: model/linear.py, keep_dense), or of int8 codes kept as they are (Int8Linear's keep_codes),
    whose matrix-vector product the graph splits over every core (one_row_in_graph, one_row_sums). An int8 head
    without them would call the same kernel in a graph and out of one."""
    head = model.lm_head
    if isinstance(head, Int8Linear):
        return head.codes is not None
    return isinstance(head, Linear) and head.weight is not None and head.dtype in GRAPH_MATRIX_VECTOR_DTYPES


@dataclass(frozen=True)
class PendingGraphs:
    """What a start's warm-up is about to do: load the graphs an earlier start saved, compile the others."""

    saved: int  # graphs an earlier start of this engine saved: loaded
    to_compile: int
    kept: bool  # compiled graphs are saved for later starts (not with --compile-gemms's frozen weights)
    last_seconds: float | None  # the last compile of this engine on this machine (any kvserve version), if known


class _ModelSlot:
    """An engine's model as its forward copy's globals reach it. Dynamo's guards keep those globals alive after the
    engine is gone (neither `reset_code` nor `torch._dynamo.reset()` lets go of them), so they hold this slot, which
    is emptied when the engine's CompiledSteps is freed, and not the model with its weights."""

    def __init__(self, model):
        self.model = model


class CompiledSteps:
    """`model.forward` compiled for decode steps: `forward` runs a step in the graph that fits it, if any."""

    def __init__(self, model, cache: PagedKVCache, gemms: bool = False, whole: bool = True):
        self.model = model
        self.cache = cache
        self.gemms = gemms  # the engine applies it only with the whole graph (attention_outside, gemms_unused)
        self.whole = whole  # the whole graph for the steps it fits (False: attention_outside says why not)
        self.failed: str | None = None
        # traced under no_grad rather than forward's inference_mode: AOTAutograd cannot mutate the pool's
        # (normal) tensors through inference-mode views
        raw_forward = getattr(type(model).forward, "__wrapped__", type(model).forward)
        raw_logits = getattr(type(model).compute_logits, "__wrapped__", type(model).compute_logits)
        # The model is reached through the function's globals, not a closure or an argument: only then does Dynamo
        # lift its weights (nn.Parameters) as the graph's parameters, which --compile-gemms freezes into constants.
        # Dynamo keeps compiled graphs on the function's code object, at most recompile_limit (8) of them: a copy of
        # the code object per engine, with globals of its own, keeps each engine's graphs its own.
        slot = _ModelSlot(model)
        weakref.finalize(self, setattr, slot, "model", None)  # the weights go with the engine (_ModelSlot)

        def copy(function=_decode_forward):  # the engine's own: its own code object, so its own graphs and guards
            return types.FunctionType(function.__code__.replace(),
                                      {"__builtins__": __builtins__, "_raw_forward": raw_forward,
                                       "_raw_logits": raw_logits, "_engine": slot}, function.__name__)

        # Each graph is compiled whole at start (torch's AOT precompile) or loaded where an earlier start of this
        # engine saved it (kvserve/saved_graphs.py): named by the model, the cache and these options.
        options = {"guard_filter_fn": step_guards, **STEP_OPTIONS}
        # first: it may set Inductor's vec_isa_ok, which the name holds (a child process per vector ISA at every
        # start, otherwise: kvserve/inductor_isa.py)
        remember_vec_isa_probe()
        key = GraphKey.of(model, cache, {"gemms": gemms, "whole": whole, "options": options})
        self._regions = layer_regions(model, cache, gemms)  # its layers as one region, traced and compiled once
        # what of the engine a graph refers to (weights, layers), by name: loaded, it refers to this engine's
        external = engine_objects(model=model, cache=cache, regions=self._regions)
        # a single stream (and several alike sequences with --compile-gemms): the whole graph; frozen weights
        # (--compile-gemms) are constants of the graph that cannot be saved: compiled at every start
        self._whole = GraphSet(copy(), {**(GEMM_OPTIONS if gemms else {}), **options}, key, external, save=not gemms)
        # several sequences, and steps the whole graph does not take: attention outside the graph (_outside_forward);
        # never frozen (--compile-gemms would pack a second copy of the weights): its weights are the graph's inputs
        self._outside = GraphSet(copy(), options, key, external)
        # one row's logits (a single stream's every step, prefill included): a graph of its own where it pays
        self._head = GraphSet(copy(_decode_logits), options, key, external) if head_in_graph(model) else None
        self.num_outside_steps = 0  # steps that ran the graph with attention outside it (prefill ones too)
        self.resident_growth = 0  # bytes the process's resident memory grew by over the warm-up
        self.compile_seconds = 0.0
        self.compile_phases: dict[str, float] = {}  # seconds of the start's compile by phase (compile_phases_line)
        self.graphs_loaded = self.graphs_compiled = 0  # at start: saved by an earlier start, or compiled now
        self.num_misses = 0  # steps that fit no graph compiled at start, run eagerly
        self._miss_reasons: set[str] = set()

    @staticmethod
    def eligible(meta: AttentionMetadata) -> bool:
        """One decode call per layer group, for the whole batch in order, over stored keys only (a single stream, or
        a batch whose context lengths are alike): what the whole graph's attention takes."""
        for groups in meta.groups:
            if len(groups) != 1:
                return False
            g = groups[0]
            if g.fresh or g.out_rows is not None or g.query_index.shape[1] != 1 or g.mask is None or \
                    g.residual_blocks is not None or g.key_slots is not None or g.sink_rotation is not None:
                return False
        return meta.tile_calls is None and meta.scores is None

    def fits_outside(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step the graph with attention outside takes: decodes, prefill chunks, both mixed, drafts being
        verified, in any number of attention calls. Its one symbol is the step's number of tokens, at least 2 where
        the whole graph takes a single stream's decodes (a prompt of one token is then a step of one token that
        neither graph takes: eager), any without it. Attention runs outside the graph as eager's does, over the
        step's own metadata, so the graph is the same for a decode token and a prompt token; not batch-invariant
        mode's tiles (its engines compile nothing)."""
        return (input_ids.shape[0] > 1 or not self.whole) and meta.tile_calls is None

    def whole_reads_less(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step the whole graph takes (`eligible`) runs there: one sequence always, and with
        --compile-gemms (its frozen graph) any number; several while their padded K/V is at most
        WHOLE_GRAPH_KV_BYTES (every layer group's padded block table, its layers' slots)."""
        if input_ids.shape[0] == 1 or self.gemms:
            return True
        return padded_kv_bytes(self.cache, meta) <= WHOLE_GRAPH_KV_BYTES

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's final hidden states, or None when this step runs eagerly: no graph covers it (one token of a
        prompt alone: fits_outside), the graph failed (eager from then on), or no graph compiled at start takes it
        (nothing compiles while serving: a compile would stall every request; that step alone runs eagerly, with one
        warning per reason)."""
        if self.failed is not None:
            return None
        if not (self.whole and self.eligible(meta) and self.whole_reads_less(input_ids, meta)):
            return self._outside_forward(input_ids, meta) if self.fits_outside(input_ids, meta) else None
        slot_mappings = meta.slot_mappings
        try:
            return self.run_whole(input_ids, meta)
        except Exception as exc:
            self.cache.begin_step([], [], slot_mappings)  # the step's own slots again, for eager
            return self._refused(exc)

    def run_whole(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                  compile_missing: bool = False) -> torch.Tensor:
        """The whole graph over a step it takes (`eligible`). Serving calls it through `forward`; `kvserve bench
        step` directly, with `compile_missing`, to time it against the graph with attention outside on steps that
        serving runs there: a graph for the step is compiled if none takes it."""
        meta, num_seqs = replace(at_least_two_blocks(meta), layer_regions=self._regions), input_ids.shape[0]
        if num_seqs == 1 and self.gemms:
            input_ids, meta = two_rows(input_ids, meta)
            self.cache.begin_step([], [], meta.slot_mappings)  # the runner began the step: now its slots, twice
        args, mark = (input_ids, meta, self.cache), lambda: mark_dynamic(input_ids, meta)
        with torch.no_grad(), freezing(self.gemms):
            if compile_missing:
                return self._whole.run_or_compile(f"whole-{input_ids.shape[0]}", args, mark)[:num_seqs]
            return self._whole(*args, mark=mark)[:num_seqs]

    def _outside_forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """A step of several tokens (decodes of several sequences, prefill chunks, both; or any step, where attention
        stays outside: attention_outside): the graph computes everything but attention, and calls attention as one
        op per layer (`kvserve::paged_attention`) over the step's own metadata, which never enters the graph (a
        stand-in with its positions does). One graph thus runs steps of any number of calls and any mix of prompt
        and decode tokens; attention runs as it does eagerly."""
        try:
            hidden = self.run_outside(input_ids, meta)
        except Exception as exc:
            return self._refused(exc)
        self.num_outside_steps += 1
        return hidden

    def run_outside(self, input_ids: torch.Tensor, meta: AttentionMetadata, attend=None) -> torch.Tensor:
        """The graph with attention outside over a decode step, its attention op calling `attend` (default:
        paged_attention over the step's cache and metadata)."""
        attend, stand_in = attend or attend_over(self.cache, meta), self._stand_in(meta)
        with torch.no_grad(), attention_outside_graph(attend):
            return self._outside(input_ids, stand_in, self.cache, mark=lambda: mark_sequences(input_ids, stand_in))

    def _stand_in(self, meta: AttentionMetadata) -> AttentionMetadata:
        """What the graph with attention outside sees of a step's metadata: its positions."""
        return replace(meta, groups=[], slot_mappings=[], outside_graph=True, layer_regions=self._regions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """One row's logits from the compiled head (head_in_graph), or None: the runner computes them eagerly (no
        compiled head, several rows, or the graphs failed)."""
        if self._head is None or self.failed is not None or hidden.shape[0] != 1:
            return None
        try:
            with torch.no_grad():
                return self._head(hidden)
        except Exception as exc:
            return self._refused(exc)

    def _refused(self, exc: Exception) -> None:
        """A step the graphs did not run: eager for this step (no graph takes it) or from now on (a failure)."""
        if isinstance(exc, GraphMiss):  # a step no graph built at start takes: compiling now would stall serving
            self.num_misses += 1
            reason = str(exc)
            if reason not in self._miss_reasons:
                self._miss_reasons.add(reason)
                logger.warning(f"a decode step fits no compiled graph ({reason}); it runs eagerly, no compiling "
                               "while serving")
            return None
        self._fail(exc)  # an Inductor or compiler failure on this machine: eager from now on
        return None

    def _whole_sizes(self) -> tuple[int, ...]:
        """The whole graph's start-up batches: one sequence and two (the number a symbol: any number above one);
        with --compile-gemms only two, which one sequence runs as two rows (two_rows)."""
        return ((2,) if self.gemms else (1, 2)) if self.whole else ()

    def _outside_sizes(self) -> tuple[int, ...]:
        return (2,) if self.whole else (1, 2)

    def pending(self) -> PendingGraphs:
        """What warm_up will load and compile, before it does: the start-up line says it first."""
        graphs = [(self._whole, f"whole-{n}") for n in self._whole_sizes()]
        graphs += [(self._outside, f"outside-{n}") for n in self._outside_sizes()]
        graphs += [(self._head, "head")] if self._head is not None else []
        saved = sum(1 for graph_set, name in graphs if graph_set.save and graph_set.key.path(name).exists())
        key = self._outside.key
        return PendingGraphs(saved, len(graphs) - saved, not self.gemms and self._outside.save,
                             CompileTimes(key.directory).last(key))

    def warm_up(self) -> bool:
        """Compile (or load) at start, and run once: the whole graph for a decode step of one sequence and one of
        two (the number a symbol: any number above one; with --compile-gemms only the latter, which one sequence
        runs as two rows: two_rows) over the pool's first blocks (the one block they write to is put back after),
        and the graph with attention outside for two sequences (without the whole graph, for one too; its
        attention op returns zeros there: it writes nothing). Returns whether all compiled."""
        started, resident, phases = time.perf_counter(), resident_bytes(), phase_seconds()
        block = self._warm_up_slot() // self.cache.block_size
        saved = self.cache.export_block(block) if self.whole else None  # the one block it writes, put back after
        try:
            for num_seqs in self._whole_sizes():
                input_ids, meta = self._warm_up_step(num_seqs)
                meta = replace(meta, layer_regions=self._regions)
                self.cache.begin_step([], [], meta.slot_mappings)
                with torch.no_grad(), freezing(self.gemms), quiet_autotuning(self.gemms):
                    mark = lambda: mark_dynamic(input_ids, meta)  # noqa: E731
                    self._whole.add(f"whole-{num_seqs}", (input_ids, meta, self.cache), mark)
                    self._whole(input_ids, meta, self.cache, mark=mark)
            for num_seqs in self._outside_sizes():
                input_ids, meta = self._warm_up_step(num_seqs)
                stand_in = self._stand_in(meta)
                with torch.no_grad(), attention_outside_graph(zero_attention):
                    self._outside.add(f"outside-{num_seqs}", (input_ids, stand_in, self.cache),
                                      lambda: mark_sequences(input_ids, stand_in))
                self.run_outside(input_ids, meta, zero_attention)
            if self._head is not None:
                head = self.model.lm_head
                hidden = torch.zeros(1, head.in_features, dtype=self.model.linears.policy.dtype,
                                     device=self.cache.device)
                with torch.no_grad():
                    self._head.add("head", (hidden,))
                    self._head(hidden)
        except Exception as exc:
            self._fail(exc)
        finally:
            if saved is not None:
                self.cache.import_block(block, saved)
        sets = [graphs for graphs in (self._whole, self._outside, self._head) if graphs is not None]
        self.graphs_loaded, self.graphs_compiled = sum(g.loaded for g in sets), sum(g.compiled for g in sets)
        self.compile_seconds = time.perf_counter() - started
        self.compile_phases = {name: seconds - phases.get(name, 0.0) for name, seconds in phase_seconds().items()}
        self.resident_growth = resident_bytes() - resident
        if self.failed is None and self.graphs_compiled and not self.graphs_loaded and \
                not torch._inductor.config.force_disable_caches:  # caches off: nothing written beside the graphs
            CompileTimes(self._outside.key.directory).remember(self._outside.key, self.compile_seconds)
        return self.failed is None

    def compile_phases_line(self) -> str:
        """How the start got its graphs, and where a compile went, as torch.compile times it: loaded ones skip it
        all (kvserve/saved_graphs.py); compiled ones spend it tracing the model's Python (Dynamo) and generating code
        (Inductor, whose own cache answers a graph it has generated before)."""
        parts = [f"{count} graph{'s' if count > 1 else ''} {how}" for count, how in
                 ((self.graphs_loaded, f"loaded from {self._outside.key.directory}"),
                  (self.graphs_compiled, "compiled")) if count]
        parts += [f"{label} {self.compile_phases[name]:.1f} s" for name, label in COMPILE_PHASES.items()
                  if self.compile_phases.get(name, 0.0) > 0]
        return f" ({', '.join(parts)})" if parts else ""

    def gemms_line(self) -> str:
        """What --compile-gemms adds to the start-up line (empty without it)."""
        if not self.gemms:
            return ""
        return (f", weights frozen into it and multiplied by Inductor's C++ GEMM template over its own packed copy "
                f"(resident memory grew by {self.resident_growth / 2**30:.2f} GiB while compiling; Inductor does not "
                "cache a graph with frozen weights: every start compiles it again)")

    def _warm_up_step(self, num_seqs: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """A decode step of `num_seqs` sequences, each at the last slot of blocks 0..WARM_UP_BLOCKS-1."""
        cache, dev = self.cache, self.cache.device
        num_blocks = min(WARM_UP_BLOCKS, cache.num_blocks)
        position = self._warm_up_slot()
        num_groups = cache.layout.num_groups

        def group() -> AttentionGroup:  # new tensors for each layer group, as the runner's: Dynamo guards aliasing
            tables = torch.arange(num_blocks, device=dev).expand(num_seqs, num_blocks).contiguous()
            mask = torch.ones(num_seqs, 1, 1, num_blocks * cache.block_size, dtype=torch.bool, device=dev)
            return AttentionGroup(torch.arange(num_seqs, device=dev)[:, None], tables, mask, None, None)

        def slots() -> torch.Tensor:
            return torch.full((num_seqs,), position, dtype=torch.long, device=dev)

        meta = AttentionMetadata(positions=slots(), slot_mappings=[slots() for _ in range(num_groups)],
                                 groups=[[group()] for _ in range(num_groups)], layer_group=cache.layout.group_of)
        return torch.zeros(num_seqs, dtype=torch.long, device=dev), meta

    def _warm_up_slot(self) -> int:
        """The slot (and position) the warm-up steps write: the last of block WARM_UP_BLOCKS - 1."""
        return min(WARM_UP_BLOCKS, self.cache.num_blocks) * self.cache.block_size - 1

    def _fail(self, exc: Exception) -> None:
        self.failed = first_line(exc)
        logger.warning(f"compiled decode step failed ({self.failed}); decode steps run eagerly from now on")
