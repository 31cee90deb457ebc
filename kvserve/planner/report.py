"""What `kvserve plan` shows: a rich report for people and a JSON object for scripts."""
from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from kvserve.planner.capacity import KVCachePlan, MemoryBudget, StatePlan
from kvserve.planner.conversation import ConversationPlan
from kvserve.planner.kv_size import (
    PER_CHANNEL,
    PER_TENSOR,
    PER_VECTOR,
    KVDtype,
    expanded_kv_bytes_per_token,
    fixed_state_bytes,
    kv_bytes_per_token,
    kv_bytes_per_token_per_layer,
    kv_layout,
    latent_words,
    request_kv_bytes,
)
from kvserve.planner.model_spec import FULL, LINEAR, SLIDING, ModelSpec
from kvserve.planner.units import GiB, format_bytes

DISK_RECORD_HEADER_BYTES = 1024  # a disk tier record's safetensors header: tensor shapes, keys, 16 token ids (< 1 KiB)
DISK_STATES_PER_TURN = 2  # a hybrid model's request saves a checkpoint at its prompt's last full block and its end


@dataclass(frozen=True)
class PlanReport:
    """Everything one `kvserve plan` invocation computed; kv_plan is None without a GPU."""

    spec: ModelSpec
    kv_dtype: KVDtype
    block_size: int
    max_model_len: int
    contexts: tuple[int, ...]
    weights_bytes: int | None
    weights_source: str
    gpu_name: str | None = None
    budget: MemoryBudget | None = None
    kv_plan: KVCachePlan | None = None
    conversation: ConversationPlan | None = None
    max_blocks_per_request: int | None = None  # a KV eviction policy's bound on one request's blocks
    kv_eviction: str = "none"  # the policy that bound comes from
    disk_cache_bytes: int | None = None  # --kv-disk-cache-size: the disk tier's cap
    state: StatePlan | None = None  # a hybrid model's state slots and checkpoints, as the engine takes them

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.spec, self.kv_dtype, self.block_size)

    @property
    def disk_record_bytes(self) -> int:
        """One full block's records on the disk tier: one per layer group, each with its header."""
        return self.block_size * self.kv_bytes_per_token + DISK_RECORD_HEADER_BYTES * kv_layout(self.spec).num_groups

    @property
    def disk_state_record_bytes(self) -> int:
        """A hybrid model's state checkpoint on the disk tier, a record of its own (0 for a model without one)."""
        return self.state.slot_bytes + DISK_RECORD_HEADER_BYTES if self.state and self.state.slot_bytes else 0

    @property
    def disk_cache_tokens(self) -> int | None:
        """Tokens the disk tier holds in blocks (a hybrid model's state checkpoints not counted: see
        disk_conversations)."""
        if self.disk_cache_bytes is None:
            return None
        return self.disk_cache_bytes // self.disk_record_bytes * self.block_size

    @property
    def disk_conversations(self) -> int | None:
        """Whole conversations the disk tier holds: their blocks, and for a hybrid model the state checkpoints each
        turn leaves beside them (DISK_STATES_PER_TURN)."""
        if self.disk_cache_bytes is None or self.conversation is None:
            return None
        blocks = -(-self.conversation.final_tokens // self.block_size)
        states = DISK_STATES_PER_TURN * len(self.conversation.turns)
        return self.disk_cache_bytes // (blocks * self.disk_record_bytes + states * self.disk_state_record_bytes)

    def disk_cache_line(self) -> str:
        """e.g. "disk tier (--kv-disk-cache-size 100.00 GiB): 812,345 tokens, 7.4x the pool's; 38 conversations"."""
        line = (f"disk tier (--kv-disk-cache-size {format_bytes(self.disk_cache_bytes)}): "
                f"{self.disk_cache_tokens:,} tokens in blocks of {self.block_size}")
        if self.kv_plan is not None and self.kv_plan.kv_cache_tokens:
            line += f", {self.disk_cache_tokens / self.kv_plan.kv_cache_tokens:,.1f}x the pool's"
        if self.disk_state_record_bytes:
            line += (f"; each request also leaves up to {DISK_STATES_PER_TURN} state checkpoints of "
                     f"{format_bytes(self.disk_state_record_bytes)} there (after its prompt's last full block and at "
                     "its reply's end)")
        if self.conversation is not None:
            line += (f"; {self.disk_conversations:,} whole conversations of "
                     f"{self.conversation.final_tokens:,} tokens (the pool: "
                     f"{self._pool_conversations()})")
        return line

    def _pool_conversations(self) -> str:
        if self.kv_plan is None:
            return "no --gpu given"
        return f"{self.kv_plan.kv_cache_tokens // self.conversation.final_tokens:,}"

    @property
    def error(self) -> str | None:
        if self.budget is not None and self.budget.error:
            return self.budget.error
        return self.kv_plan.error if self.kv_plan is not None else None

    def context_tokens_per_gib(self, tokens: int | None = None) -> float:
        """Tokens of context a GiB of KV cache serves for requests of `tokens` (default max_model_len), as the
        engine's start-up line says: what an eviction policy's bound on a request's blocks buys."""
        tokens = tokens or self.max_model_len
        return tokens * GiB / self.request_bytes(tokens)

    def eviction_line(self) -> str:
        """What the eviction policy's bound holds per request, and the context a GiB serves, against the full
        cache's."""
        tokens = self.max_model_len
        full = request_kv_bytes(self.spec, self.kv_dtype, tokens, self.block_size)
        return (f"Under --kv-eviction {self.kv_eviction}: a request of {tokens:,} tokens holds "
                f"{format_bytes(self.request_bytes(tokens))} of KV cache (all of it: {format_bytes(full)}), "
                f"{self.context_tokens_per_gib():,.0f} tokens of context per GiB "
                f"({full / self.request_bytes(tokens):.1f}x the full cache's)")

    def request_bytes(self, tokens: int) -> int:
        kv = request_kv_bytes(self.spec, self.kv_dtype, tokens, self.block_size)
        if self.max_blocks_per_request is None:
            return kv
        block_bytes = self.block_size * kv_bytes_per_token(self.spec, self.kv_dtype, self.block_size)
        return min(kv, self.max_blocks_per_request * block_bytes)


def kv_formula(spec: ModelSpec, dtype: KVDtype, block_size: int) -> str:
    """The bytes-per-token formula with this model's numbers substituted."""
    layers = f"{spec.num_kv_layers} layers"
    if spec.num_kv_layers != spec.num_layers:
        layers = f"{spec.num_kv_layers} attention layers (of {spec.num_layers})"
    if spec.is_mla:
        vector = f"({spec.kv_lora_rank} kv_lora_rank + {spec.qk_rope_head_dim} qk_rope_head_dim)"
        head = f"{layers} × {_vector_bytes(vector, spec.kv_vector_elements, dtype, block_size, False)}"
    else:
        vector = f"{spec.head_dim} head_dim"
        key = _vector_bytes(vector, spec.head_dim, dtype, block_size, True)
        value = _vector_bytes(vector, spec.head_dim, dtype, block_size, False)
        heads = f"{layers} × {spec.num_kv_heads} KV heads"
        head = f"2 (K, V) × {heads} × {value}" if key == value else f"{heads} × (K {key} + V {value})"
    total = kv_bytes_per_token(spec, dtype, block_size)
    return f"KV bytes/token = {head} = {total:,} B = {format_bytes(total)}"


def _vector_bytes(vector: str, elements: int, dtype: KVDtype, block_size: int, key: bool) -> str:
    element = f"{dtype.bits(key) / 8:g} B ({dtype.name})"
    scope = dtype.scope(key)
    scale_bytes, zero_point_bytes = dtype.stat_bytes(key)
    per_scale = scale_bytes + zero_point_bytes
    what = "scale" if not zero_point_bytes else "scale + zero point"
    if scope == PER_VECTOR:
        return f"({vector} × {element} + {per_scale} B {what})"
    if scope == PER_CHANNEL:
        return f"({vector} × {element} + {elements} channels × {per_scale} B {what} / {block_size}-token block)"
    return f"{vector} × {element}"


def kv_notes(spec: ModelSpec, dtype: KVDtype, block_size: int) -> list[str]:
    """What the formula alone does not say: windows, fixed states, quantization scales."""
    notes = []
    if spec.num_layers_of(SLIDING):
        grow = spec.num_layers_of(FULL) * kv_bytes_per_token_per_layer(spec, dtype, block_size)
        past = f"grows by {format_bytes(grow)}/token" if grow else "stops growing"
        notes.append(
            f"{spec.num_layers_of(SLIDING)} of {spec.num_layers} layers attend to a {spec.sliding_window:,}-token "
            f"sliding window and never hold more; past it a request {past}."
        )
    expanded = expanded_kv_bytes_per_token(spec, dtype, block_size)
    if expanded is not None:
        notes.append(
            f"MLA: one {latent_words(spec.kv_lora_rank, spec.qk_rope_head_dim)} instead of per-head K and V; "
            f"cached expanded, {spec.num_attention_heads} heads × (K {spec.qk_nope_head_dim} + "
            f"{spec.qk_rope_head_dim} rope, V {spec.v_head_dim}) would take {expanded:,} B/token, "
            f"{expanded / kv_bytes_per_token(spec, dtype, block_size):.1f}× as much."
        )
    if spec.num_layers_of(LINEAR):
        state = fixed_state_bytes(spec)
        size = f"a fixed {format_bytes(state)} per request" if state else "a fixed state (size not in the config)"
        notes.append(f"{spec.num_layers_of(LINEAR)} linear-attention layers hold no KV, only {size}.")
    if dtype.codebook:
        half_range = "an fp16" if dtype.stat_bytes(True)[0] == 2 else "a 1-byte (logarithmic)"
        notes.append(f"{dtype.name}: K and V Hadamard-rotated; keys {dtype.bits(True)}-bit per channel per "
                     f"{block_size}-token block (an fp16 midpoint and {half_range} half range), values "
                     f"{dtype.bits(False)}-bit indices into a fixed Lloyd-Max codebook with one fp16 scale per token "
                     "and head; each sequence's partly filled last block stays in full precision outside the pool.")
    elif dtype.key_scale_scope == PER_CHANNEL:
        notes.append(f"{dtype.name} (KIVI): keys get an fp16 scale and zero point per channel per {block_size}-token "
                     "block, values per token and head; each sequence's partly filled last block stays in full "
                     "precision outside the pool.")
    elif dtype.scale_scope == PER_VECTOR:
        kind = "symmetric" if not dtype.zero_point_bytes else "asymmetric"
        notes.append(f"{dtype.name}, per-token-head scales (kvserve's own storage): one fp16 scale per token, layer "
                     f"and head vector ({kind}, dynamic). --kv-scales per-tensor plans one scale per layer instead, "
                     "as vLLM's FP8 KV cache keeps them.")
    elif dtype.scale_scope == PER_TENSOR:
        notes.append(f"{dtype.name}, per-tensor scales: one scale per layer for K and one for V, no bytes per token "
                     f"(as vLLM's FP8 KV cache keeps them); kvserve's own {dtype.name} stores one per token and head "
                     "vector (--kv-scales per-token-head).")
    return notes


def state_lines(state: StatePlan) -> list[str]:
    """What a hybrid model's state costs in the engine: per request, per checkpoint, and the slots it reserves."""
    slot = format_bytes(state.slot_bytes)
    checkpoints = (f" + {state.num_checkpoints:,} checkpoints (prefix caching)" if state.num_checkpoints
                   else " (no checkpoints: prefix caching off)")
    return [
        f"State per request: {slot} (conv tail + recurrent state of {state.num_linear_layers} linear-attention "
        "layers, float32 as the engine keeps it); a checkpoint, the state at a block boundary that a prefix hit "
        f"resumes from, is one more {slot}.",
        f"The engine takes {state.num_slots:,} slots (--max-num-seqs){checkpoints} = "
        f"{state.num_slots + state.num_checkpoints:,} × {slot} = {format_bytes(state.total_bytes)} out of the KV "
        "budget before its blocks; no more requests than slots run at once.",
    ]


def kv_format_label(dtype: KVDtype) -> str | None:
    """What the capacity line names: a scaled format and where its scales are; None for plain elements and for
    formats with per-channel keys (int4 and the nuq formats)."""
    if dtype.scale_scope in (PER_VECTOR, PER_TENSOR) and dtype.key_scale_scope is None:
        return f"{dtype.name}, {dtype.scales} scales"
    return None


def report_to_json(report: PlanReport) -> dict:
    """The --json object: capacity keys are null when no GPU was given."""
    plan, spec = report.kv_plan, report.spec
    data = {
        "model": spec.name,
        "model_type": spec.model_type,
        "attention": spec.attention_kind,
        "kv_cache_dtype": report.kv_dtype.name,
        "kv_scales": report.kv_dtype.scales,
        "max_blocks_per_request": report.max_blocks_per_request,
        "kv_eviction": report.kv_eviction,
        "context_tokens_per_gib": report.context_tokens_per_gib(),
        "block_size": report.block_size,
        "kv_bytes_per_token": report.kv_bytes_per_token,
        "kv_bytes_per_token_formula": kv_formula(spec, report.kv_dtype, report.block_size),
        "fixed_state_bytes_per_request": fixed_state_bytes(spec),
        **_state_json(report.state),
        "num_parameters": spec.num_parameters,
        "weights_bytes": report.weights_bytes,
        "gpu": report.gpu_name,
        "gpu_memory_bytes": report.budget.gpu_memory_bytes if report.budget else None,
        "gpu_memory_utilization": report.budget.gpu_memory_utilization if report.budget else None,
        "overhead_bytes": report.budget.overhead_bytes if report.budget else None,
        "kv_budget_bytes": report.budget.kv_budget_bytes if report.budget else None,
        "num_blocks": plan.num_blocks if plan else None,
        "kv_cache_tokens": plan.kv_cache_tokens if plan else None,
        "kv_cache_bytes": plan.kv_cache_bytes if plan else None,
        "max_model_len": report.max_model_len,
        "max_concurrency": plan.max_concurrency if plan else None,
        "fits": plan.fits if plan else None,
        "error": report.error,
        "per_request": [
            {"tokens": t, "bytes": report.request_bytes(t), "max_concurrency": plan.concurrency(t) if plan else None}
            for t in report.contexts
        ],
    }
    if report.conversation is not None:
        data.update(_conversation_json(report.conversation))
    if report.disk_cache_bytes is not None:
        data.update(disk_cache_bytes=report.disk_cache_bytes, disk_cache_tokens=report.disk_cache_tokens,
                    disk_state_record_bytes=report.disk_state_record_bytes,
                    disk_conversations=report.disk_conversations)
    return data


def _state_json(state: StatePlan | None) -> dict:
    """The state slots the engine takes (null for a model without them); a checkpoint is one slot's bytes."""
    return {
        "num_state_slots": state.num_slots if state else None,
        "num_state_checkpoints": state.num_checkpoints if state else None,
        "state_checkpoint_bytes": state.slot_bytes if state else None,
        "state_cache_bytes": state.total_bytes if state else None,
    }


def _conversation_json(conversation: ConversationPlan) -> dict:
    return {
        "turns": [vars(turn) for turn in conversation.turns],
        "prefill_tokens_without_prefix_cache": conversation.prefill_tokens_without_prefix_cache,
        "prefill_tokens_with_prefix_cache": conversation.prefill_tokens_with_prefix_cache,
        "new_input_tokens": conversation.new_input_tokens,
        "final_tokens": conversation.final_tokens,
        "final_kv_bytes": conversation.final_kv_bytes,
    }


def render_report(report: PlanReport, console: Console) -> None:
    """The human-readable report: model, formula, per-request sizes, GPU capacity, conversation."""
    spec = report.spec
    kv_heads = (latent_words(spec.kv_lora_rank, spec.qk_rope_head_dim) if spec.is_mla
                else f"{spec.num_kv_heads} KV heads")
    console.print(
        f"[bold]{spec.name}[/bold] ({spec.model_type}, {spec.attention_kind}: {spec.num_attention_heads} query heads, "
        f"{kv_heads}, {spec.num_layers} layers, max {spec.max_position_embeddings:,} tokens)"
    )
    console.print(kv_formula(spec, report.kv_dtype, report.block_size), highlight=False, soft_wrap=True)
    for note in kv_notes(spec, report.kv_dtype, report.block_size):
        console.print(f"  • {note}", highlight=False, soft_wrap=True)
    for line in state_lines(report.state) if report.state is not None else []:
        console.print(line, highlight=False, soft_wrap=True)
    weights = format_bytes(report.weights_bytes) if report.weights_bytes is not None else "unknown"
    console.print(f"Weights: {report.weights_source} = {weights}", highlight=False)
    if report.conversation is not None:
        console.print(_conversation_table(report))
    else:
        console.print(_per_request_table(report))
    if report.max_blocks_per_request is not None:
        console.print(report.eviction_line(), highlight=False, soft_wrap=True)
    if report.budget is not None:
        console.print(_budget_table(report))
        if report.kv_plan is not None and report.budget.error is None:
            label = "; ".join(filter(None, [kv_format_label(report.kv_dtype), latent_words(
                spec.kv_lora_rank, spec.qk_rope_head_dim) if spec.is_mla else None]))
            console.print(report.kv_plan.summary_line(label or None), highlight=False, soft_wrap=True)
    if report.disk_cache_bytes is not None:
        console.print(report.disk_cache_line(), highlight=False, soft_wrap=True)
    if report.error:
        console.print(f"[bold red]error:[/bold red] {report.error}", highlight=False, soft_wrap=True)


def _per_request_table(report: PlanReport) -> Table:
    table = Table(title=f"KV cache per request (blocks of {report.block_size} tokens)")
    table.add_column("tokens", justify="right")
    table.add_column("KV cache", justify="right")
    if report.state is not None:
        table.add_column("state", justify="right")
    if report.kv_plan is not None:
        table.add_column("requests at once", justify="right")
    for tokens in report.contexts:
        row = [f"{tokens:,}", format_bytes(report.request_bytes(tokens))]
        if report.state is not None:
            row.append(format_bytes(report.state.slot_bytes))
        if report.kv_plan is not None:
            row.append(f"{report.kv_plan.concurrency(tokens):.2f}")
        table.add_row(*row)
    return table


def _budget_table(report: PlanReport) -> Table:
    budget, plan = report.budget, report.kv_plan
    table = Table(title=f"GPU capacity: {report.gpu_name or 'custom'}", show_header=False)
    table.add_column("step")
    table.add_column("value", justify="right")
    table.add_row("GPU memory", format_bytes(budget.gpu_memory_bytes))
    table.add_row(f"× utilization {budget.gpu_memory_utilization:g}", format_bytes(budget.usable_bytes))
    table.add_row("− weights", format_bytes(budget.weights_bytes))
    table.add_row("− overhead (runtime, activations)", format_bytes(budget.overhead_bytes))
    table.add_row("= KV cache budget", format_bytes(budget.kv_budget_bytes))
    if plan is not None and budget.error is None:
        if plan.state is not None:
            state = plan.state
            table.add_row(f"− state: {state.num_slots:,} slots + {state.num_checkpoints:,} checkpoints × "
                          f"{format_bytes(state.slot_bytes)}", format_bytes(state.total_bytes))
        block = f"blocks of {plan.block_size} tokens ({format_bytes(plan.block_bytes)} each)"
        table.add_row(block, f"{plan.num_blocks:,}")
        counting = " (counting every layer)" if report.spec.num_layers_of(SLIDING) else ""
        table.add_row(f"tokens that fit{counting}", f"{plan.kv_cache_tokens:,}")
        slots = " (KV and a state slot each)" if plan.state is not None else ""
        table.add_row(f"requests of max_model_len {plan.max_model_len:,} at once{slots}",
                      f"{plan.max_concurrency:.2f}")
    return table


def _conversation_table(report: PlanReport) -> Table:
    conv = report.conversation
    table = Table(title=f"Conversation, one request per turn (blocks of {report.block_size} tokens)")
    for column in ("turn", "new input", "prompt", "tokens at end", "KV at end",
                   "prefilled (no prefix cache)", "prefilled (prefix cache)"):
        table.add_column(column, justify="right")
    for t in conv.turns:
        table.add_row(str(t.turn), f"{t.new_input_tokens:,}", f"{t.prompt_tokens:,}", f"{t.final_tokens:,}",
                      format_bytes(t.kv_bytes), f"{t.prefill_tokens_without_prefix_cache:,}",
                      f"{t.prefill_tokens_with_prefix_cache:,}")
    table.add_row("total", f"{conv.new_input_tokens:,}", "", f"{conv.final_tokens:,}",
                  format_bytes(conv.final_kv_bytes), f"{conv.prefill_tokens_without_prefix_cache:,}",
                  f"{conv.prefill_tokens_with_prefix_cache:,}", style="bold")
    table.caption = (f"{conv.prefill_tokens_without_prefix_cache:,} tokens prefilled for "
                     f"{conv.new_input_tokens:,} new input tokens ({conv.recompute_factor:.1f}×) without "
                     f"prefix caching; {conv.prefill_tokens_with_prefix_cache:,} with it")
    return table
