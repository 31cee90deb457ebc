"""The Gemma 3 text decoder (Gemma3ForCausalLM) as plain tensor code over a flat batch.

Against Llama: embeddings scaled by sqrt(hidden), RMSNorm weights stored as w in (1 + w), a norm before and after
both attention and MLP, per-head q/k norms, a GeGLU (tanh-gelu) MLP, attention scaled by query_pre_attn_scalar,
and two kinds of layer — sliding-window ones with a local RoPE base, full-attention ones with the global base."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kv.kv_cache import PagedKVCache
from kvserve.model.attention import AttentionMetadata, paged_attention, run_layer
from kvserve.model.config import SLIDING_ATTENTION, ModelConfig
from kvserve.model.linear import Linears, WeightsPolicy, load_linears, tensor_storages, weights_nbytes
from kvserve.model.rotary import RotaryEmbedding
from kvserve.rotation import apply_rotary


class Gemma3Norm:
    """Gemma's RMSNorm: computed in float32 with scale (1 + w), as transformers does for every model dtype."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.scale = 1.0 + weight.float()
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.scale.shape, self.scale, self.eps).to(x.dtype)

    def storages(self) -> dict[int, int]:
        return tensor_storages(self.scale)


class Gemma3DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, layer_type: str,
                 linears: Linears):
        a = f"{prefix}.self_attn"
        # q, k, v and gate, up are fused: one matmul each instead of three and two
        self.qkv = linears.linear(torch.cat([w[f"{a}.{p}_proj.weight"] for p in "qkv"]),
                                  torch.cat([w[f"{a}.{p}_proj.bias"] for p in "qkv"]) if cfg.attention_bias else None)
        self.o_proj = linears.linear(w[f"{a}.o_proj.weight"])
        self.gate_up = linears.linear(torch.cat([w[f"{prefix}.mlp.gate_proj.weight"],
                                                 w[f"{prefix}.mlp.up_proj.weight"]]))
        self.down = linears.linear(w[f"{prefix}.mlp.down_proj.weight"])

        def norm(name: str) -> Gemma3Norm:
            return Gemma3Norm(w[f"{name}.weight"], cfg.rms_norm_eps)

        self.q_norm, self.k_norm = norm(f"{a}.q_norm"), norm(f"{a}.k_norm")
        self.input_norm = norm(f"{prefix}.input_layernorm")
        self.post_attention_norm = norm(f"{prefix}.post_attention_layernorm")
        self.pre_feedforward_norm = norm(f"{prefix}.pre_feedforward_layernorm")
        self.post_feedforward_norm = norm(f"{prefix}.post_feedforward_layernorm")
        self.cfg = cfg
        self.layer_type = layer_type
        self.sliding_window = cfg.sliding_window if layer_type == SLIDING_ATTENTION else None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        # per-token work runs as meta.tiles cuts it (batch-invariant mode: fixed tiles); attention sees the batch
        q, k, v = meta.tiles.map(self._qkv, h, cos, sin)
        out = paged_attention(q, k, v, layer, cache, meta, self.scale)
        return meta.tiles.map(self._output_and_mlp, h, out)

    def _qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        qkv = self.qkv(self.input_norm(h))
        q = self.q_norm(qkv[:, : self.q_size].view(-1, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, cfg.num_kv_heads, cfg.head_dim))
        v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        qk = apply_rotary(torch.cat([q, k], dim=1), cos, sin)  # q and k heads rotated in one pass
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        return q, k, v

    def _output_and_mlp(self, h: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_norm(self.o_proj(attention.reshape(-1, self.q_size)))
        x = self.pre_feedforward_norm(h)
        gate, up = self.gate_up(x).split(self.cfg.intermediate_size, dim=-1)
        mlp = self.down(F.gelu(gate, approximate="tanh") * up)
        return h + self.post_feedforward_norm(mlp)

    def weight_parts(self) -> list:
        """The linears and norms this layer holds (for weights_nbytes)."""
        return [self.qkv, self.o_proj, self.gate_up, self.down, self.q_norm, self.k_norm, self.input_norm,
                self.post_attention_norm, self.pre_feedforward_norm, self.post_feedforward_norm]


class Gemma3Model:
    """Weights plus forward(); `layer_types` says which layers slide over the last `sliding_window` tokens."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 policy: WeightsPolicy = WeightsPolicy()):
        w, linears, self.lm_head, self.embed = load_linears(weights, cfg.tie_word_embeddings, policy)
        self.cfg = cfg
        self.linears = linears
        # transformers multiplies in the model dtype, so bf16 scales by sqrt(hidden) rounded to bf16
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=policy.dtype, device=policy.device)
        self.norm = Gemma3Norm(w["model.norm.weight"], cfg.rms_norm_eps)
        self.layers = [Gemma3DecoderLayer(cfg, w, f"model.layers.{i}", t, linears)
                       for i, t in enumerate(cfg.layer_types)]
        self.full_rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                           policy.dtype, policy.device)
        self.sliding_rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.sliding_rope_theta,
                                              cfg.sliding_rope_scaling, policy.dtype, policy.device)

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.cfg.layer_types

    @property
    def sliding_window(self) -> int | None:
        return self.cfg.sliding_window

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] flat tokens of all requests. Returns final hidden states [T, hidden]."""
        h = meta.tiles.map(self._embed, input_ids)
        full_rope = self.full_rotary.lookup(meta.positions)
        sliding_rope = self.sliding_rotary.lookup(meta.positions)
        for i, layer in enumerate(self.layers):
            # the layer's type from the config, not the layer: read from the layer object, Dynamo would know it
            # by the model's path and reuse a layer region with the first layer's weights (compile/steps.py)
            cos, sin = sliding_rope if self.cfg.layer_types[i] == SLIDING_ATTENTION else full_rope
            h = run_layer(layer, h, cos, sin, i, cache, meta)
        return meta.tiles.map(self.norm, h)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * self.embed_scale

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight the model holds, in the form it computes with (tied tables counted once)."""
        return weights_nbytes(self.embed, self.lm_head, self.norm, *(p for layer in self.layers for p in layer.weight_parts()))
