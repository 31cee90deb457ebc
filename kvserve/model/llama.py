"""The Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2) as plain tensor code over a flat batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kv.kv_cache import PagedKVCache
from kvserve.model.attention import AttentionMetadata, paged_attention, run_layer
from kvserve.model.config import ModelConfig
from kvserve.model.linear import Linears, WeightsPolicy, load_linears, weights_nbytes
from kvserve.model.rotary import RotaryEmbedding
from kvserve.rotation import apply_rotary


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, linears: Linears):
        a = f"{prefix}.self_attn"
        # q, k, v and gate, up are fused: one matmul each instead of three and two
        self.qkv = linears.linear(torch.cat([w[f"{a}.{p}_proj.weight"] for p in "qkv"]),
                                  torch.cat([w[f"{a}.{p}_proj.bias"] for p in "qkv"]) if cfg.attention_bias else None)
        self.o_proj = linears.linear(w[f"{a}.o_proj.weight"])
        self.q_norm = w.get(f"{a}.q_norm.weight")
        self.k_norm = w.get(f"{a}.k_norm.weight")
        self.gate_up = linears.linear(torch.cat([w[f"{prefix}.mlp.gate_proj.weight"],
                                                 w[f"{prefix}.mlp.up_proj.weight"]]))
        self.down = linears.linear(w[f"{prefix}.mlp.down_proj.weight"])
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_attention_norm = w[f"{prefix}.post_attention_layernorm.weight"]
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        # per-token work runs as meta.tiles cuts it (batch-invariant mode: fixed tiles); attention sees the batch
        q, k, v = meta.tiles.map(self._qkv, h, cos, sin)
        out = paged_attention(q, k, v, layer, cache, meta, self.scale)
        return meta.tiles.map(self._output_and_mlp, h, out)

    def _qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        qkv = self.qkv(self._rms_norm(h, self.input_norm))
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, num_qk_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self._rms_norm(qk[:, : cfg.num_heads], self.q_norm),
                            self._rms_norm(qk[:, cfg.num_heads :], self.k_norm)], dim=1)
        qk = apply_rotary(qk, cos, sin)  # q and k heads rotated in one pass
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        return q, k, v

    def _output_and_mlp(self, h: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        h = h + self.o_proj(attention.reshape(-1, self.q_size))
        x = self._rms_norm(h, self.post_attention_norm)
        gate, up = self.gate_up(x).split(self.cfg.intermediate_size, dim=-1)
        return h + self.down(F.silu(gate) * up)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.cfg.rms_norm_eps)

    def weight_parts(self) -> list:
        """The linears and norm weights this layer holds (for weights_nbytes)."""
        norms = [self.q_norm, self.k_norm, self.input_norm, self.post_attention_norm]
        return [self.qkv, self.o_proj, self.gate_up, self.down] + [t for t in norms if t is not None]


class LlamaModel:
    """Weights plus forward(); holds no per-request state (that lives in the cache and the metadata)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 policy: WeightsPolicy = WeightsPolicy()):
        w, linears, self.lm_head, self.embed = load_linears(weights, cfg.tie_word_embeddings, policy)
        self.cfg = cfg
        self.linears = linears
        self.norm = w["model.norm.weight"]
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}", linears) for i in range(cfg.num_layers)]
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, policy.dtype,
                                      policy.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] flat tokens of all requests. Returns final hidden states [T, hidden]."""
        h = meta.tiles.map(self.embed, input_ids)
        cos, sin = self.rotary.lookup(meta.positions)
        for i, layer in enumerate(self.layers):
            h = run_layer(layer, h, cos, sin, i, cache, meta)
        return meta.tiles.map(self._final_norm, h)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, self.norm.shape, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight the model holds, in the form it computes with (tied tables counted once)."""
        return weights_nbytes(self.embed, self.lm_head, self.norm, *(p for layer in self.layers for p in layer.weight_parts()))
