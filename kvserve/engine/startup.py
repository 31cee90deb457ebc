"""What an engine built, as data, and the start-up lines that say it. The builder (engine/builder.py) logs each
part's line as soon as that part is built; LLMEngine.capacity_line() words the cache's facts again when asked,
as the cache describes itself then (its decode attention may have fallen back to eager)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.batch_invariant import TILE_ROWS
from kvserve.compile.steps import PendingGraphs
from kvserve.config import SpeculativeConfig
from kvserve.planner.capacity import KVCachePlan


@dataclass(frozen=True)
class WeightsFacts:
    """The model's weights in memory: their bytes, their form, and the copies a kernel keeps of some of them."""

    nbytes: int
    dtype: str  # the float dtype's name (norms are held in it under int8)
    quantization: str | None  # "int8": linear weights quantized to int8
    fallback_kernel_reason: str | None = None  # int8 codes held as float32 for the fallback kernel: why
    tied_copy_nbytes: int = 0  # a kernel's packed copy of the tied embedding table
    dense_copy_nbytes: int = 0  # dense weights (int8: codes) kept beside packed copies for compiled decode steps
    matmul_name: str = ""  # the float linear kernel (int8: the int8 kernel) whose packed copies those are


@dataclass(frozen=True)
class CacheFacts:
    """The KV pool the planner sized, how its format and layer groups describe themselves, and its staging."""

    plan: KVCachePlan
    format_description: str
    layout_description: str
    staging_nbytes: int  # full-precision staging for partly filled blocks (int4), 0 for other formats
    max_num_seqs: int


@dataclass(frozen=True)
class CompiledAttentionFacts:
    """A KV format's decode attention (and other kernels: `kernels`) compiled at start: their graphs loaded (saved
    by an earlier start, or built by an earlier engine of this process) and compiled (kv/formats/compiled.py)."""

    format_name: str
    compile_s: float
    graphs_loaded: int = 0
    graphs_compiled: int = 0
    kernels: tuple[str, ...] = ("decode attention",)


@dataclass(frozen=True)
class CompiledStepsFacts:
    """How decode steps were compiled (--compile-decode): whether attention runs outside the graph and why, and
    how compile/steps.py accounts for the start's graphs and GEMMs."""

    attention_outside: str | None  # None: a whole graph takes attention too
    whole_graph_kv_bytes: int  # several sequences run in a whole graph while their padded K/V is at most this
    compile_s: float
    phases: str  # CompiledSteps.compile_phases_line()
    gemms: str  # CompiledSteps.gemms_line()


def weights_line(facts: WeightsFacts) -> str:
    """e.g. "weights: 135.5 MB int8 (per-output-channel scales; activations per token)"."""
    if facts.quantization == "int8":
        form = ("int8 (per-output-channel scales, activations quantized per token, both rotated; norms in "
                f"{facts.dtype})")
        if facts.fallback_kernel_reason is not None:
            form += f"; the codes are held as float32 for the fallback kernel ({facts.fallback_kernel_reason})"
        if facts.tied_copy_nbytes:
            form += (f"; of which {facts.tied_copy_nbytes / 1e6:,.1f} MB is the int8 kernel's own copy of the tied "
                     "embedding table (lookups read the codes, the output head its packed copy)")
        if facts.dense_copy_nbytes:
            form += (f"; of which {facts.dense_copy_nbytes / 1e6:,.1f} MB the codes kept as they are beside "
                     f"{facts.matmul_name}'s packed copies for compiled decode steps: the single stream's graph "
                     "multiplies them in loops of its own")
    else:
        form = facts.dtype
        copies = []
        if facts.tied_copy_nbytes:
            copies.append(f"{facts.tied_copy_nbytes / 1e6:,.1f} MB is {facts.matmul_name}'s packed copy of "
                          "the tied embedding table: lookups read the table, the output head its packed copy")
        if facts.dense_copy_nbytes:
            copies.append(f"{facts.dense_copy_nbytes / 1e6:,.1f} MB the dense weights kept beside "
                          f"{facts.matmul_name}'s packed copies for compiled decode: a single stream multiplies them "
                          "in loops of their own")
        if copies:
            form += f" (of which {'; '.join(copies)})"
    return f"weights: {facts.nbytes / 1e6:,.1f} MB {form}"


def capacity_line(facts: CacheFacts) -> str:
    """The pool the planner sized, its storage format and layer groups."""
    described = "; ".join(filter(None, [facts.format_description, facts.layout_description]))
    line = facts.plan.summary_line(described)
    if facts.staging_nbytes:
        line += (f"; plus {facts.staging_nbytes / 2**20:.1f} MiB of full-precision staging for partly "
                 f"filled blocks (2 blocks for each of {facts.max_num_seqs} sequences)")
    return line


def batch_invariance_line(batch_invariant: bool, block_size: int, chunked_eviction: str | None = None) -> str:
    """Which guarantee holds (docs/architecture.md, "Batch invariance"). `chunked_eviction`: the name of an eviction
    policy that decides what to keep between prompt chunks (H2O, the per-head ones), under which none holds."""
    if chunked_eviction is not None:
        return (f"batch invariance: none under {chunked_eviction} eviction: it decides what to keep between prompt "
                "chunks, from what the chunks so far attended to, so how a prompt is chunked (by the batch beside "
                "it, the token budget, a preemption) moves what it keeps and the tokens; StreamingLLM's window and "
                "no eviction do not depend on it")
    if batch_invariant:
        return (f"batch invariance: bitwise (--batch-invariant: every per-token op on tiles of {TILE_ROWS} "
                f"tokens, attention per {block_size}-token query tile); a request's logits do not "
                "depend on its batch, chunking, prefix hits or preemption")
    return ("batch invariance: same greedy tokens batched or alone up to float rounding (a lossy KV format "
            "may flip a near-tie); --batch-invariant makes logits bitwise independent of the batch")


def compiled_kernel_parts(loaded: int, compiled: int) -> str:
    """How a start got a compiled kernel's graphs, as the start-up lines say it."""
    graphs = [f"{count} graph{'s' if count > 1 else ''} {how}" for count, how in
              ((loaded, "loaded"), (compiled, "compiled")) if count]
    return f"({''.join(f'{part}, ' for part in graphs)}torch.compile; --enforce-eager skips it)"


def compiled_attention_line(facts: CompiledAttentionFacts) -> str:
    return (f"{facts.format_name} {' and '.join(facts.kernels)} compiled in {facts.compile_s:.1f} s "
            f"{compiled_kernel_parts(facts.graphs_loaded, facts.graphs_compiled)}")


def compiled_state_update_line(kind: str, seconds: float, kernel) -> str:
    """How a hybrid model's decode steps read and update the recurrent states (kv/state_cache.py,
    delta_rule_step)."""
    if kind != "compiled":
        return f"state cache: decode update eager (compiling it failed: {kernel.failed})"
    return (f"state cache: decode update (the recurrent states read, decayed and given their rank-one update) "
            f"compiled into one pass in {seconds:.1f} s "
            f"{compiled_kernel_parts(kernel.graphs_loaded, kernel.graphs_compiled)}")


def one_row_loop_line(seconds: float, loop) -> str:
    """How eager steps multiply one row by the float weights (model/linear.py, OneRowLoop)."""
    if loop.failed:
        return f"one-row products: the weights' matmul route (compiling their loop failed: {loop.failed})"
    return (f"one-row products (eager steps): the compiled graphs' float32 loop over the dense weights, compiled "
            f"in {seconds:.1f} s {compiled_kernel_parts(loop.compiled.graphs_loaded, loop.compiled.graphs_compiled)}")


def speculation_line(config: SpeculativeConfig) -> str:
    """The speculative decoding method and its bounds (engine/speculative.py)."""
    if config.method == "ngram":
        how = f"prompt lookup of {config.prompt_lookup_min}..{config.prompt_lookup_max}-grams"
    else:
        how = (f"suffix match up to {config.suffix_decoding_max_tree_depth} tokens over the request and the last "
               f"{config.suffix_decoding_max_cached_requests} outputs")
    return (f"speculative decoding: {config.method}, up to {config.num_speculative_tokens} draft tokens ({how}), "
            f"while at most {config.disable_by_batch_size} sequences decode in a step (disable_by_batch_size)")


def eager_steps_line(reason: str) -> str:
    """No decode step runs compiled: turned off, or not supported for this model or its settings."""
    return f"decode steps: eager ({reason})"


def compiling_steps_line(pending: PendingGraphs) -> str:
    """Said before the warm-up: what it loads, what it compiles and about how long that takes."""
    if not pending.to_compile:
        return f"decode steps: loading {pending.saved} saved compiled graphs (--enforce-eager skips compiling)"
    if pending.last_seconds is not None:
        how_long = f"the last compile of this engine on this machine took {pending.last_seconds:.0f} s"
    else:
        how_long = ("none compiled for this engine on this machine before: expect tens of seconds on a small CPU, "
                    "minutes with --compile-gemms (docs/benchmarks.md, `kvserve bench startup`)")
    later = ("later starts load them" if pending.kept else
             "--compile-gemms's frozen weights cannot be saved: every start compiles them")
    loaded = f", loading {pending.saved} saved" if pending.saved else ""
    return (f"decode steps: compiling {pending.to_compile} graphs now{loaded} ({how_long}; {later}; nothing compiles "
            "while serving; --enforce-eager skips this)")


def gemms_not_applied_line(reason: str) -> str:
    return f"--compile-gemms: not applied ({reason}); the decode step compiles without it"


def compiled_steps_line(facts: CompiledStepsFacts) -> str:
    """Which graphs decode steps run in, and what compiling them took."""
    if facts.attention_outside is None:
        graphs = ("compiled (torch.compile; --enforce-eager turns it off): one sequence in a whole graph, several in "
                  "another while their K/V padded to the longest is at most "
                  f"{facts.whole_graph_kv_bytes / 2**20:,.0f} MiB, the others (any number, any context lengths) in one "
                  "with attention outside it")
    else:
        graphs = (f"one compiled graph with attention outside it (torch.compile, --enforce-eager turns it off; "
                  f"{facts.attention_outside})")
    return (f"decode steps: {graphs}, in {facts.compile_s:.1f} s{facts.phases}{facts.gemms}; prefill and mixed steps "
            "in the graph with attention outside it too")
