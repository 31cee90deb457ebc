"""GPU memory → KV cache: the budget left after weights, the blocks it holds, concurrency, and refusals.

The engine sizes its block pool with `plan_kv_cache` and prints `summary_line()`, so the planner's
prediction and the engine's allocation are the same computation.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.kv_size import (
    HEAD_STREAM_POLICIES,
    PER_TOKEN_HEAD_SCALES,
    KVDtype,
    eviction_kv_dtype,
    fixed_state_bytes,
    kv_bytes_per_token,
    kv_layout,
    request_kv_bytes,
    resolve_kv_dtype,
    round_up_to_blocks,
    state_slot_bytes,
)
from kvserve.planner.model_spec import LINEAR, ModelSpec
from kvserve.planner.units import GiB, KiB, format_bytes

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64  # the engine's max_num_seqs: a hybrid model's state slots, one per sequence
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Memory that is neither weights nor KV cache: CUDA context and cuBLAS/NCCL workspaces (~0.5-1 GiB),
# the activation peak of a prefill chunk, CUDA graphs, allocator fragmentation. 1.5 GiB is an estimate,
# not a measurement; it puts Llama 3.1 8B (bf16) on a 24 GiB RTX 4090 at ~42K KV tokens, the middle of
# the 38K-46K that the seed article computes. Override it with --overhead-gib.
DEFAULT_OVERHEAD_BYTES = 3 * GiB // 2


@dataclass(frozen=True)
class MemoryBudget:
    """GPU memory × utilization − weights − overhead = what the KV cache may use."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES

    def __post_init__(self) -> None:
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"GPU memory must be positive, got {self.gpu_memory_bytes} bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.weights_bytes < 0 or self.overhead_bytes < 0:
            raise ValueError("weights and overhead sizes must not be negative")

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_budget_bytes(self) -> int:
        return max(0, self.usable_bytes - self.weights_bytes - self.overhead_bytes)

    @property
    def error(self) -> str | None:
        """Why nothing is left for the KV cache, or None."""
        if self.kv_budget_bytes > 0:
            return None
        return (
            f"weights ({format_bytes(self.weights_bytes)}) plus overhead ({format_bytes(self.overhead_bytes)}) "
            f"leave no memory for the KV cache out of {format_bytes(self.usable_bytes)} usable "
            f"({format_bytes(self.gpu_memory_bytes)} × {self.gpu_memory_utilization:g}). Use a GPU with more "
            "memory, smaller weights (--weights-dtype fp8 or int4) or a higher --gpu-memory-utilization."
        )


@dataclass(frozen=True)
class StatePlan:
    """A hybrid model's state slots, carved out of the KV budget before the blocks: one per sequence that may run
    at once (max_num_seqs), each every linear layer's conv tail and recurrent state in float32, and as many
    checkpoint slots again with prefix caching (states saved at block boundaries, so that a hit resumes)."""

    num_slots: int
    slot_bytes: int
    num_linear_layers: int
    num_checkpoints: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + self.num_checkpoints) * self.slot_bytes

    def line(self) -> str:
        checkpoints = f" + {self.num_checkpoints:,} checkpoints" if self.num_checkpoints else ""
        return (f"state cache: {self.num_slots:,} slots{checkpoints} × {format_bytes(self.slot_bytes)} (conv tail + "
                f"recurrent state of {self.num_linear_layers} linear-attention layers, float32) = "
                f"{format_bytes(self.total_bytes)}, one slot per running sequence")


@dataclass(frozen=True)
class KVCachePlan:
    """A block pool carved out of a KV budget: every block holds block_size tokens of every KV layer."""

    spec: ModelSpec
    kv_dtype: KVDtype
    kv_budget_bytes: int
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    num_blocks: int
    layers_per_block: int  # a block holds block_size tokens of this many layers (one layer group)
    max_blocks_per_request: int | None = None  # a KV eviction policy's bound on one sequence's blocks
    eviction: str = "none"
    state: StatePlan | None = None  # hybrid models in the engine: state slots taken from the budget first

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token * self.layers_per_block // self.spec.num_kv_layers

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the pool holds if every layer keeps every token (a uniform model's capacity)."""
        return self.num_blocks * self.block_size * self.layers_per_block // self.spec.num_kv_layers

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def request_bytes(self, tokens: int) -> int:
        """Memory one request of `tokens` needs: its KV blocks (windows applied) plus any fixed state."""
        kv = request_kv_bytes(self.spec, self.kv_dtype, tokens, self.block_size)
        if self.max_blocks_per_request is not None:
            kv = min(kv, self.max_blocks_per_request * self.block_bytes)
        return kv + (0 if self.state is not None else fixed_state_bytes(self.spec))  # slots hold their state

    def concurrency(self, tokens: int) -> float:
        """How many requests of `tokens` tokens the cache holds at once; with state slots (a hybrid model in the
        engine) each request also holds a slot, so never more than there are slots."""
        by_kv = self.kv_cache_bytes / self.request_bytes(tokens)
        return by_kv if self.state is None else min(by_kv, self.state.num_slots)

    def context_tokens_per_gib(self, tokens: int | None = None) -> float:
        """Tokens of context a GiB of KV cache serves for requests of `tokens` (default max_model_len): what an
        eviction policy's bound on a request's blocks buys."""
        tokens = tokens or self.max_model_len
        return tokens * GiB / self.request_bytes(tokens)

    @property
    def max_concurrency(self) -> float:
        return self.concurrency(self.max_model_len)

    @property
    def fits(self) -> bool:
        return self.request_bytes(self.max_model_len) <= self.kv_cache_bytes

    @property
    def max_fitting_len(self) -> int:
        """Largest max_model_len (whole blocks, at most max_model_len) whose request fits the cache."""
        low, high = 0, round_up_to_blocks(self.max_model_len, self.block_size)
        while low < high:  # request_bytes grows with length, so bisect on the number of blocks
            mid = (low + high + 1) // 2
            if self.request_bytes(mid * self.block_size) <= self.kv_cache_bytes:
                low = mid
            else:
                high = mid - 1
        return min(low * self.block_size, self.max_model_len)

    @property
    def error(self) -> str | None:
        """None when one max_model_len request fits, else a refusal in the spirit of vLLM's."""
        if self.state is not None and self.state.total_bytes > self.kv_budget_bytes:
            return (f"{self.spec.name}: {self.state.num_slots + self.state.num_checkpoints:,} state slots (one per "
                    f"max_num_seqs{', and as many checkpoints' if self.state.num_checkpoints else ''}) of "
                    f"{format_bytes(self.state.slot_bytes)} take {format_bytes(self.state.total_bytes)}, more than the "
                    f"{format_bytes(self.kv_budget_bytes)} KV cache memory; lower max_num_seqs or raise "
                    "kv_cache_memory")
        if self.fits:
            return None
        fit = self.max_fitting_len
        lower = f"lower --max-model-len to {fit:,} or less, or " if fit else ""
        return (
            f"{self.spec.name}: max_model_len {self.max_model_len:,} (the model's maximum length is "
            f"{self.spec.max_position_embeddings:,}) needs {format_bytes(self.request_bytes(self.max_model_len))} "
            f"of KV cache for one request, more than the {format_bytes(self.kv_cache_bytes)} KV cache"
            f"{f' (left after the {self.state.num_slots:,} state slots)' if self.state else ''}, which "
            f"holds {self.kv_cache_tokens:,} tokens ({self.num_blocks:,} blocks of {self.block_size}). "
            f"The largest max_model_len that fits is {fit:,}. To start, {lower}give the KV cache more memory: "
            "raise kv_cache_memory / --gpu-memory-utilization, use --kv-cache-dtype fp8, or a GPU with more memory."
        )

    def summary_line(self, kv_format: str | None = None) -> str:
        """The start-up capacity line the engine logs, naming the storage format when given."""
        blocks = f"{self.num_blocks:,} blocks × {self.block_size} tokens"
        if self.layers_per_block != self.spec.num_kv_layers:
            blocks += f" × {self.layers_per_block} layers ({self.kv_cache_tokens:,} tokens in every layer)"
        else:
            blocks += f" = {self.kv_cache_tokens:,} tokens"
        per_request = f"{self.max_model_len:,} tokens per request"
        if self.max_blocks_per_request is not None:
            per_request = (f"{self.eviction} eviction, at most {self.max_blocks_per_request:,} blocks per request "
                           "at any length")
        if self.eviction in HEAD_STREAM_POLICIES:
            blocks += (f" (as {self.num_blocks * self.spec.num_kv_layers * self.spec.num_kv_heads:,} blocks of one "
                       f"layer's one KV head: {self.context_tokens_per_gib():,.0f} tokens of context per GiB at "
                       f"{self.max_model_len:,} tokens)")
        return (
            f"KV cache{f' ({kv_format})' if kv_format else ''}: {blocks}, {self.kv_cache_bytes / GiB:.2f} GiB "
            f"({self.kv_bytes_per_token / KiB:.1f} KiB/token); maximum concurrency for {per_request}: "
            f"{self.max_concurrency:.2f}x" + (f"; {self.state.line()}" if self.state is not None else "")
        )


def resolve_max_model_len(spec: ModelSpec, max_model_len: int | None) -> int:
    """max_model_len, defaulting to the model's maximum length and never beyond it."""
    if max_model_len is None:
        return spec.max_position_embeddings
    if not 1 <= max_model_len <= spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} must be between 1 and {spec.name}'s maximum length "
            f"{spec.max_position_embeddings:,}"
        )
    return max_model_len


def plan_state(spec: ModelSpec, state_slots: int | None, state_checkpoints: int = 0) -> StatePlan | None:
    """A hybrid model's state slots and checkpoints as the engine allocates them; None for a model without linear
    layers (or whose config does not give their state's size), or when no slots are asked for."""
    if state_slots is None or not state_slot_bytes(spec):
        return None
    if state_slots < 1 or state_checkpoints < 0:
        raise ValueError(f"a hybrid model needs at least one state slot (max_num_seqs), got {state_slots}, and "
                         f"no negative number of checkpoints, got {state_checkpoints}")
    return StatePlan(state_slots, state_slot_bytes(spec), spec.num_layers_of(LINEAR), state_checkpoints)


def plan_kv_cache(
    spec: ModelSpec,
    kv_budget_bytes: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: str = "bf16",
    max_model_len: int | None = None,
    eviction: str = "none",
    max_blocks_per_request: int | None = None,
    kv_scales: str = PER_TOKEN_HEAD_SCALES,
    state_slots: int | None = None,
    state_checkpoints: int = 0,
) -> KVCachePlan:
    """Blocks that fit in kv_budget_bytes for this model and dtype; max_model_len defaults to the model's.
    With a KV eviction policy, `max_blocks_per_request` bounds what one request holds at any length;
    `kv_scales` "per-tensor" plans a scaled format with one scale per layer (vLLM's FP8 cache), not the engine's.
    `state_slots` (the engine, for a hybrid model): that many state slots come out of the budget first, the rest
    is KV blocks (and `state_checkpoints` checkpoint slots beside them)."""
    if kv_budget_bytes < 0:
        raise ValueError(f"KV cache budget must not be negative, got {kv_budget_bytes} bytes")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    max_model_len = resolve_max_model_len(spec, max_model_len)
    kv_dtype = eviction_kv_dtype(eviction, resolve_kv_dtype(kv_cache_dtype, spec, kv_scales))
    per_token = kv_bytes_per_token(spec, kv_dtype, block_size)
    if per_token == 0:
        raise ValueError(f"{spec.name} has no attention layer that keeps a KV cache")
    layers_per_block = kv_layout(spec).layers_per_block
    block_bytes = block_size * per_token * layers_per_block // spec.num_kv_layers
    state = plan_state(spec, state_slots, state_checkpoints)
    kv_bytes = max(0, int(kv_budget_bytes) - (state.total_bytes if state else 0))
    return KVCachePlan(
        spec=spec,
        kv_dtype=kv_dtype,
        kv_budget_bytes=int(kv_budget_bytes),
        block_size=block_size,
        max_model_len=max_model_len,
        kv_bytes_per_token=per_token,
        num_blocks=kv_bytes // block_bytes,
        layers_per_block=layers_per_block,
        max_blocks_per_request=max_blocks_per_request,
        eviction=eviction,
        state=state,
    )
