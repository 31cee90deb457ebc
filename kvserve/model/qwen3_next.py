"""The Qwen3-Next and Qwen3.5 text decoders (Qwen3NextForCausalLM, Qwen3_5ForCausalLM) as plain tensor code over a
flat batch: hybrid models whose layers are mostly Gated DeltaNet (linear attention over a fixed state per sequence,
kv/state_cache.py) with a full-attention layer every few layers (paged KV, like every model here).

Against Llama: RMSNorms scale by (1 + w), full attention gates its output with a sigmoid of a second query half and
rotates only the first partial_rotary_factor of each head, and the linear layers run a causal conv and the gated
delta rule (model/gated_delta.py), continuing from the sequence's state slot. Qwen3-Next fuses its linear layers'
in-projections grouped by key head; they are reordered once at load into Qwen3.5's split layout."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvserve.kv.kv_cache import PagedKVCache
from kvserve.kv.state_cache import PromptRound, StateStep
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.config import LINEAR_ATTENTION, HybridMoEConfig, LinearAttentionConfig, ModelConfig
from kvserve.model.deepseek import MLP
from kvserve.model.gated_delta import (causal_conv, chunked_gated_delta_rule, conv_step_, qk_norm_and_scale,
                                       recurrent_gated_delta_rule_)
from kvserve.model.gemma3 import Gemma3Norm as ZeroCenteredNorm
from kvserve.model.linear import Linears, WeightsPolicy, load_linears, tensor_storages, weights_nbytes
from kvserve.model.rotary import RotaryEmbedding
from kvserve.rotation import apply_rotary

logger = logging.getLogger("kvserve")
LANGUAGE_MODEL_PREFIX = "model.language_model."  # Qwen3.5/3.6 released checkpoints (*ForConditionalGeneration)
SKIPPED_PREFIXES = {"model.visual.": "the vision tower", "mtp.": "the multi-token prediction layer"}


def text_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's weights under its names (a vision-language checkpoint's are under model.language_model);
    a vision tower and a multi-token prediction layer, which a checkpoint of either layout may hold, are skipped,
    with one log line saying so."""
    skipped = sorted({what for name in weights for prefix, what in SKIPPED_PREFIXES.items()
                      if name.startswith(prefix)})
    if skipped:
        logger.info(f"weights: {' and '.join(skipped)} skipped (kvserve runs the text model)")
    composite = any(name.startswith(LANGUAGE_MODEL_PREFIX) for name in weights)
    return {name.replace(LANGUAGE_MODEL_PREFIX, "model.", 1) if composite else name: t for name, t in weights.items()
            if not any(name.startswith(prefix) for prefix in SKIPPED_PREFIXES)}


class GatedNorm:
    """RMSNorm of each value head's output (plain weight), then times silu(z), in float32."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight.float()
        self.eps = eps

    def __call__(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps) * F.silu(z.float())

    def storages(self) -> dict[int, int]:
        return tensor_storages(self.weight)


def split_in_projections(w: dict[str, torch.Tensor], prefix: str, lc: LinearAttentionConfig) -> list[torch.Tensor]:
    """A linear layer's in-projections as [qkv, z, b, a] rows in Qwen3.5's order (q, k, v flat by head)."""
    if not lc.fused_projections:
        return [w[f"{prefix}.in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]
    per_group = lc.num_value_heads // lc.num_key_heads  # value heads per key head
    hidden = w[f"{prefix}.in_proj_qkvz.weight"].shape[-1]
    qkvz = w[f"{prefix}.in_proj_qkvz.weight"].view(lc.num_key_heads, -1, hidden)
    q, k, v, z = qkvz.split([lc.key_head_dim, lc.key_head_dim, per_group * lc.value_head_dim,
                             per_group * lc.value_head_dim], dim=1)
    b, a = w[f"{prefix}.in_proj_ba.weight"].view(lc.num_key_heads, -1, hidden).split([per_group, per_group], dim=1)
    flat = [t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]
    return [torch.cat(flat[:3]), *flat[3:]]


class GatedDeltaNetLayer:
    """A linear-attention layer: fused in-projection, causal conv and gated delta rule over the sequence's state
    slot, gated norm, out-projection."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, linears: Linears, index: int):
        lc = cfg.linear
        self.lc = lc
        self.index = index  # among the linear layers: the state cache's row
        self.in_proj = linears.linear(torch.cat(split_in_projections(w, prefix, lc)))
        self.conv_weight = w[f"{prefix}.conv1d.weight"].squeeze(1).float()  # [C, K]
        self.conv_taps = self.conv_weight.T.contiguous()  # [K, C]: a decode token's taps, each a contiguous row
        self.neg_a = -w[f"{prefix}.A_log"].float().exp()
        self.dt_bias = w[f"{prefix}.dt_bias"].float()
        self.norm = GatedNorm(w[f"{prefix}.norm.weight"], cfg.rms_norm_eps)
        self.out_proj = linears.linear(w[f"{prefix}.out_proj.weight"])

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] of the step's flat batch; positions (cos, sin) and the KV cache are not read here."""
        lc, step = self.lc, meta.state
        qkv, z, b, a = self.in_proj(x).split([lc.conv_dim, lc.value_dim, lc.num_value_heads, lc.num_value_heads], -1)
        beta = b.float().sigmoid()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(x.shape[0], lc.num_value_heads, lc.value_head_dim, dtype=torch.float32, device=x.device)
        if len(step.decodes):
            out[step.decode_rows] = self._decode(qkv, g, beta, step)
            for slot, checkpoint in step.decode_checkpoints:
                step.save(self.index, slot, checkpoint)
        for rows, slot in step.drafts.rows if step.drafts is not None else ():
            out[rows] = self._mix_drafted(qkv[rows], g[rows], beta[rows], step, slot)
        for prompts in step.prompt_rounds:
            if len(prompts.slots):
                out[prompts.rows[prompts.real]] = self._prompts(qkv, g, beta, step, prompts)[prompts.real]
            for slot, checkpoint in prompts.checkpoints:  # the state at a block boundary inside a chunk
                step.save(self.index, slot, checkpoint)
        z = z.view(-1, lc.num_value_heads, lc.value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(x.shape[0], -1).to(x.dtype))

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, step: StateStep) -> torch.Tensor:
        """The decodes' one token each, their conv tails and states updated where they lie in the pool (a view when
        their slots are one run). Returns [D, Hv, Dv] float32."""
        decodes, rows = step.decodes, step.decode_rows
        conv, state = step.cache.conv[self.index], step.cache.recurrent[self.index]
        tails, states = decodes.read(conv), decodes.read(state)
        mixed = conv_step_(qkv[rows].float(), tails, self.conv_taps)
        q, k, v = self._heads(mixed[:, None])
        out = recurrent_gated_delta_rule_(q, k, v, g[rows][:, None], beta[rows][:, None], states,
                                          step.cache.delta_rule_step)
        decodes.write(conv, tails)
        decodes.write(state, states)
        return out[:, 0]

    def _prompts(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, step: StateStep,
                 prompts: PromptRound) -> torch.Tensor:
        """A round of prompt pieces, one per sequence padded to the longest, in one chunked call from their slots'
        states (zeros for a piece that starts its sequence: none read when every piece does). Returns
        [B, L, Hv, Dv] float32."""
        conv, state = step.cache.conv[self.index], step.cache.recurrent[self.index]
        fresh = prompts.fresh
        tails = torch.where(fresh, 0.0, prompts.slots.read(conv))
        states = None if prompts.all_fresh else torch.where(fresh[..., None], 0.0, prompts.slots.read(state))
        mixed, tails = causal_conv(qkv[prompts.rows].float().transpose(1, 2), tails, self.conv_weight,
                                   prompts.lengths)
        q, k, v = self._heads(mixed.transpose(1, 2))
        rows = prompts.rows
        out, states = chunked_gated_delta_rule(q, k, v, g[rows], beta[rows], states, lengths=prompts.lengths,
                                               in_place=True)  # `states` is this call's own (torch.where's) or new
        prompts.slots.write(conv, tails)
        prompts.slots.write(state, states)
        return out

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [B, T, C] as q, k (normalized, q scaled, one per value head) and v, by head."""
        lc = self.lc
        q, k, v = mixed.split([lc.key_dim, lc.key_dim, lc.value_dim], dim=-1)
        batch, tokens = q.shape[:2]
        q, k = (t.reshape(batch, tokens, lc.num_key_heads, lc.key_head_dim) for t in (q, k))
        q, k = qk_norm_and_scale(q, k)
        per_group = lc.num_value_heads // lc.num_key_heads
        if per_group > 1:  # each key head serves per_group consecutive value heads
            q, k = q.repeat_interleave(per_group, dim=2), k.repeat_interleave(per_group, dim=2)
        return q, k, v.reshape(batch, tokens, lc.num_value_heads, lc.value_head_dim)

    def _mix_drafted(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, step: StateStep,
                     slot: int) -> torch.Tensor:
        """A drafted sequence's last token and draft ([T, C]) as a chunk, leaving with the rollback
        (kv/draft_states.py) the conv inputs and how to recompute the state after any of its first tokens."""
        conv, state = step.cache.conv[self.index], step.cache.recurrent[self.index]
        conv_input = torch.cat([conv[slot].T, qkv.float().T], dim=-1)
        mixed, tail = causal_conv(qkv.float().T[None], conv[slot][None], self.conv_weight)
        conv[slot] = tail[0]
        q, k, v = self._heads(mixed.transpose(1, 2))
        before = state[slot][None].clone()  # the slot's state before the step, which the rollback recomputes from

        def resume(n: int) -> torch.Tensor:
            return chunked_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[None, :n], beta[None, :n], before)[1][0]

        step.drafts.record(self.index, slot, conv_input, resume)
        out, after = chunked_gated_delta_rule(q, k, v, g[None], beta[None], before)
        state[slot] = after[0]
        return out[0]

    def weight_parts(self) -> list:
        return [self.in_proj, self.out_proj, self.conv_weight, self.conv_taps, self.neg_a, self.dt_bias, self.norm]


class GatedAttentionLayer:
    """Full attention with per-head q/k norms, RoPE over the first rotary_dim dims of each head, and its output
    gated by sigmoid of a second half of the query projection."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, linears: Linears, index: int):
        self.cfg = cfg
        self.index = index  # among the attention layers: the KV layout's layer
        # q_proj holds each head's query then its gate; q (with gate), k and v in one matmul
        self.qkv = linears.linear(torch.cat([w[f"{prefix}.{p}_proj.weight"] for p in "qkv"]))
        self.o_proj = linears.linear(w[f"{prefix}.o_proj.weight"])
        self.q_norm = ZeroCenteredNorm(w[f"{prefix}.q_norm.weight"], cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredNorm(w[f"{prefix}.k_norm.weight"], cfg.rms_norm_eps)
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        q_gate, k, v = self.qkv(x).split([2 * self.q_size, cfg.num_kv_heads * cfg.head_dim,
                                          cfg.num_kv_heads * cfg.head_dim], dim=-1)
        q, gate = q_gate.view(-1, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        q = self._rotate(self.q_norm(q), cos, sin)
        k = self._rotate(self.k_norm(k.view(-1, cfg.num_kv_heads, cfg.head_dim)), cos, sin)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        out = paged_attention(q, k, v, self.index, cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size) * torch.sigmoid(gate.reshape(-1, self.q_size)))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def weight_parts(self) -> list:
        return [self.qkv, self.o_proj, self.q_norm, self.k_norm]


def unmerge_experts(w: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Experts stored merged ([E, 2I, H] gate_up_proj, [E, H, I] down_proj, as transformers holds them) into the
    per-expert names of the released checkpoints, in place."""
    gate_up, down = w.pop(f"{prefix}.gate_up_proj", None), w.pop(f"{prefix}.down_proj", None)
    if gate_up is None or down is None:
        return
    for e in range(num_experts):
        gate, up = gate_up[e].chunk(2, dim=0)
        w[f"{prefix}.{e}.gate_proj.weight"], w[f"{prefix}.{e}.up_proj.weight"] = gate, up
        w[f"{prefix}.{e}.down_proj.weight"] = down[e]


class SparseMoE:
    """Each token's top k experts by softmax router scores (renormalized with norm_topk_prob), weighted, plus the
    shared expert scaled by sigmoid of its gate."""

    def __init__(self, moe: HybridMoEConfig, w: dict[str, torch.Tensor], prefix: str, linears: Linears):
        self.moe = moe
        unmerge_experts(w, f"{prefix}.experts", moe.num_experts)
        self.router = w[f"{prefix}.gate.weight"]
        self.experts = [MLP(w, f"{prefix}.experts.{e}", linears) for e in range(moe.num_experts)]
        self.shared = MLP(w, f"{prefix}.shared_expert", linears)
        self.shared_gate = w[f"{prefix}.shared_expert_gate.weight"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = scores.topk(self.moe.num_experts_per_tok, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype))
        return out

    def weight_parts(self) -> list:
        return [self.router, self.shared_gate, *self.shared.weight_parts(),
                *(p for e in self.experts for p in e.weight_parts())]


class HybridDecoderLayer:
    """Norm, token mixer (linear or full attention), residual; norm, SwiGLU MLP or sparse MoE, residual."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, layer: int, linears: Linears,
                 mixer: GatedDeltaNetLayer | GatedAttentionLayer):
        self.mixer = mixer
        moe = cfg.hybrid_moe
        self.mlp = (SparseMoE(moe, w, f"{prefix}.mlp", linears) if moe is not None and moe.is_moe_layer(layer)
                    else MLP(w, f"{prefix}.mlp", linears))
        self.input_norm = ZeroCenteredNorm(w[f"{prefix}.input_layernorm.weight"], cfg.rms_norm_eps)
        self.post_attention_norm = ZeroCenteredNorm(w[f"{prefix}.post_attention_layernorm.weight"], cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.mixer(self.input_norm(h), cos, sin, cache, meta)
        return h + self.mlp(self.post_attention_norm(h))

    def weight_parts(self) -> list:
        return [*self.mixer.weight_parts(), *self.mlp.weight_parts(), self.input_norm, self.post_attention_norm]


class Qwen3NextModel:
    """Weights plus forward(); per-sequence state lives in the KV and state caches, handed in by the metadata."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 policy: WeightsPolicy = WeightsPolicy()):
        w, linears, self.lm_head, self.embed = load_linears(text_weights(weights), cfg.tie_word_embeddings, policy)
        self.cfg = cfg
        self.linears = linears
        self.norm = ZeroCenteredNorm(w["model.norm.weight"], cfg.rms_norm_eps)
        self.layers = []
        counts = {LINEAR_ATTENTION: 0, "attention": 0}
        for i, kind in enumerate(cfg.layer_types):
            prefix = f"model.layers.{i}"
            if kind == LINEAR_ATTENTION:
                mixer = GatedDeltaNetLayer(cfg, w, f"{prefix}.linear_attn", linears, counts[LINEAR_ATTENTION])
                counts[LINEAR_ATTENTION] += 1
            else:
                mixer = GatedAttentionLayer(cfg, w, f"{prefix}.self_attn", linears, counts["attention"])
                counts["attention"] += 1
            self.layers.append(HybridDecoderLayer(cfg, w, prefix, i, linears, mixer))
        self.num_linear_layers = counts[LINEAR_ATTENTION]
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, policy.dtype,
                                      policy.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] flat tokens of all requests. Returns final hidden states [T, hidden]."""
        if meta.state is None:
            raise ValueError("a hybrid model's step needs its sequences' state slots (AttentionMetadata.state)")
        h = self.embed(input_ids)
        cos, sin = self.rotary.lookup(meta.positions)
        for layer in self.layers:
            h = layer.forward(h, cos, sin, cache, meta)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight the model holds, in the form it computes with (tied tables counted once)."""
        return weights_nbytes(self.embed, self.lm_head, self.norm,
                              *(p for layer in self.layers for p in layer.weight_parts()))
