"""The few facts of an HF config.json that the forward pass needs (Llama family, Gemma 3, DeepSeek-V2/V3)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",  # the released checkpoints: the text model is run
    "Qwen3_5MoeForCausalLM": "qwen3_5_text",  # Qwen3.5/3.6 MoE: the same layers with a sparse MoE feed-forward
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_text",
}
VISION_LANGUAGE_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
DEEPSEEK_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5_text")  # Gated DeltaNet layers beside full attention
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet: a fixed state per sequence, no KV (kv/state_cache.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEEPSEEK_ROPE_TYPES = ("default", "yarn")
# Gemma 3's defaults when its config leaves them out (transformers' Gemma3TextConfig)
GEMMA3_ROPE_THETA = 1_000_000.0
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # five sliding-window layers, then one full-attention layer
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256


@dataclass(frozen=True)
class DeepseekConfig:
    """What DeepSeek-V2/V3 add: Multi-head Latent Attention's ranks and head parts, and the MoE feed-forward."""

    q_lora_rank: int | None  # None: queries come from one full projection (V2-Lite), else a low-rank pair with a norm
    kv_lora_rank: int  # the latent every head's keys and values are expanded from (what the cache holds)
    qk_nope_head_dim: int  # per-head query/key part without position
    qk_rope_head_dim: int  # the decoupled RoPE part: per-head queries, one key shared by every head (cached)
    v_head_dim: int
    rope_interleave: bool  # RoPE pairs adjacent dims (DeepSeek's checkpoints) rather than the two halves
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int  # the first k layers keep a dense MLP
    moe_layer_freq: int  # after those, every moe_layer_freq-th layer is MoE
    routed_scaling_factor: float
    scoring: str  # "softmax" (V2) or "sigmoid" with a learned per-expert bias for the choice (V3)
    topk_method: str  # V2: "greedy" or "group_limited_greedy"; V3: "noaux_tc"
    n_group: int | None  # experts form n_group groups; only the best topk_group groups are chosen from
    topk_group: int | None
    norm_topk_prob: bool  # the chosen experts' weights are renormalized to sum to 1

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet's sizes (Qwen3-Next, Qwen3.5): key/query heads, value heads and the causal conv's kernel."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped by key head; Qwen3.5: four linears

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the conv runs over: q, k and v."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class HybridMoEConfig:
    """Qwen3-Next's sparse MoE feed-forward: each token's top k of num_experts by softmax router scores, plus one
    shared expert scaled by a sigmoid gate; layers outside mlp_only_layers whose (index + 1) divides by
    decoder_sparse_step use it."""

    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2, some Llamas)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    layer_types: tuple[str, ...]  # per layer: FULL_ATTENTION, or SLIDING_ATTENTION over the last sliding_window
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # set only when the config turns sliding-window attention on
    sliding_rope_theta: float | None = None  # sliding layers' own RoPE (Gemma 3's local base); None: as full layers
    sliding_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set (Gemma)
    # DeepSeek's MLA and MoE; then num_kv_heads and head_dim describe the cached vector: one latent + rope "head"
    deepseek: DeepseekConfig | None = None
    # hybrid models: the linear-attention layers' sizes, and the share of head_dim full attention rotates
    linear: LinearAttentionConfig | None = None
    hybrid_moe: HybridMoEConfig | None = None
    partial_rotary_factor: float = 1.0
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        cfg = _language_model_config(cfg)
        arch = _architecture(cfg)
        if arch in HYBRID_ARCHITECTURES:
            _check_hybrid(cfg)
        heads = cfg["num_attention_heads"]
        full_rope, sliding_rope = _rope_by_layer_type(cfg, arch)
        deepseek = _deepseek_fields(cfg, arch) if arch in DEEPSEEK_ARCHITECTURES else None
        rope_theta, rope_scaling = _rope(full_rope, DEEPSEEK_ROPE_TYPES if deepseek else SUPPORTED_ROPE_TYPES)
        eos = cfg.get("eos_token_id")
        sliding_window = _sliding_window(cfg)
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=_intermediate_size(cfg),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=1 if deepseek else cfg.get("num_key_value_heads") or heads,
            head_dim=(deepseek.kv_lora_rank + deepseek.qk_rope_head_dim if deepseek
                      else cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3_text", *HYBRID_ARCHITECTURES),
            layer_types=_layer_types(cfg, arch, cfg["num_hidden_layers"], sliding_window),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            sliding_window=sliding_window,
            **(_gemma3_fields(cfg, sliding_rope) if arch == "gemma3_text" else {}),
            deepseek=deepseek,
            **(_hybrid_fields(cfg, arch, full_rope) if arch in HYBRID_ARCHITECTURES else {}),
            hf_config=dict(cfg),
        )


def _rope_by_layer_type(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """RoPE parameters of full-attention layers, and of sliding layers where the model gives them their own."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:  # transformers 5 writes one entry per layer type
        return params[FULL_ATTENTION], params.get(SLIDING_ATTENTION)
    full = dict(params or cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta", GEMMA3_ROPE_THETA if arch == "gemma3_text" else 10000.0))
    if arch != "gemma3_text":
        return full, None
    # older Gemma 3 configs: rope_theta and rope_scaling are the global layers', rope_local_base_freq the local ones'
    return full, {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)}


def _rope(params: dict[str, Any],
          supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one layer type's RoPE parameters; scaling is None for plain RoPE."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(supported)} are)")
    scaling = None if rope_type == "default" else dict(params, rope_type=rope_type)
    return params.get("rope_theta", 10000.0), scaling


def _gemma3_fields(cfg: dict[str, Any], sliding_rope: dict[str, Any] | None) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not a causal LM; "
                         "kvserve runs causal Gemma3ForCausalLM models")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    sliding_theta, sliding_scaling = _rope(sliding_rope or {"rope_theta": GEMMA3_LOCAL_ROPE_THETA})
    # attn_logit_softcapping is read by transformers' Gemma 3 but never applied, so it is ignored here too
    return dict(
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=sliding_scaling,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", GEMMA3_QUERY_PRE_ATTN_SCALAR),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def _deepseek_fields(cfg: dict[str, Any], arch: str) -> DeepseekConfig:
    """MLA and MoE fields with the defaults of the original DeepSeek configs; V3 routes with sigmoid scores."""
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"DeepSeek hidden_act {activation!r} is not supported (silu is)")
    if cfg.get("quantization_config"):  # DeepSeek-V3's own checkpoint: fp8 blocks beside weight_scale_inv tensors
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(f"DeepSeek checkpoints quantized with {method!r} are not supported; convert the weights to "
                         "bfloat16 first (kvserve loads plain safetensors weights)")
    v3 = arch == "deepseek_v3"
    return DeepseekConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=cfg.get("rope_interleave", True) if v3 else True,  # V2 always pairs adjacent dims
        n_routed_experts=cfg.get("n_routed_experts") or 0,
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
        moe_layer_freq=cfg.get("moe_layer_freq", 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        scoring="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else cfg.get("topk_method", "greedy"),
        n_group=cfg.get("n_group"),
        topk_group=cfg.get("topk_group"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
    )


def _intermediate_size(cfg: dict[str, Any]) -> int:
    """The dense MLP's width; a MoE config may leave it out when no layer is dense (Qwen3.5/3.6 MoE), others may not."""
    if "intermediate_size" in cfg:
        return cfg["intermediate_size"]
    if cfg.get("num_experts") and not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1:
        return 0
    raise ValueError("config.json has no intermediate_size (the MLP's width), which this model needs")


def _language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5/3.6's vision-language checkpoints (dense and MoE): the text model's config (text_config), with the
    top level's architecture and embedding tie; other configs (other vision-language models are refused) unchanged."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or not set(VISION_LANGUAGE_ARCHITECTURES) & set(cfg.get("architectures") or []):
        return cfg
    return {**text, **{key: cfg[key] for key in ("architectures", "tie_word_embeddings") if key in cfg}}


def _check_hybrid(cfg: dict[str, Any]) -> None:
    """What kvserve's Gated DeltaNet models do not run yet, refused by name; a state dtype other than float32 is
    said (states stay float32)."""
    state_dtype = cfg.get("mamba_ssm_dtype", "float32")
    if state_dtype != "float32":
        logging.getLogger("kvserve").warning(
            f"{cfg.get('model_type')}: mamba_ssm_dtype={state_dtype!r} in the config, but kvserve keeps Gated DeltaNet "
            "states in float32 (as the released checkpoints ask): they take the memory float32 takes, which "
            "`kvserve plan` and the start-up line count")
    activation = cfg.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{cfg.get('model_type')} hidden_act {activation!r} is not supported (silu is)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{cfg.get('model_type')} with attention_bias=true is not supported")


def _hybrid_fields(cfg: dict[str, Any], arch: str, full_rope: dict[str, Any]) -> dict[str, Any]:
    linear = LinearAttentionConfig(
        num_key_heads=cfg["linear_num_key_heads"],
        num_value_heads=cfg["linear_num_value_heads"],
        key_head_dim=cfg["linear_key_head_dim"],
        value_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        fused_projections=arch == "qwen3_next",
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ValueError(f"linear_num_value_heads={linear.num_value_heads} must be a multiple of "
                         f"linear_num_key_heads={linear.num_key_heads}")
    factor = full_rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    moe = None
    if cfg.get("num_experts"):
        moe = HybridMoEConfig(num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                              decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                              mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
    return dict(linear=linear, partial_rotary_factor=float(factor), hybrid_moe=moe)


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int, sliding_window: int | None) -> tuple[str, ...]:
    """Each layer's attention: from layer_types, Gemma's interleave pattern, or the window's presence."""
    if arch in HYBRID_ARCHITECTURES:
        return _hybrid_layer_types(cfg, num_layers)
    if sliding_window is None:
        return (FULL_ATTENTION,) * num_layers
    if cfg.get("layer_types") is not None:
        types = tuple(cfg["layer_types"])
        unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if len(types) != num_layers or unknown:
            raise ValueError(f"layer_types must give {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} for each of the "
                             f"{num_layers} layers; got {len(types)} entries{f', unknown {unknown}' if unknown else ''}")
        return types
    if arch == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN
        return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers))
    if "max_window_layers" in cfg:  # Qwen2: the bottom max_window_layers layers keep full attention
        return tuple(SLIDING_ATTENTION if i >= cfg["max_window_layers"] else FULL_ATTENTION for i in range(num_layers))
    return (SLIDING_ATTENTION,) * num_layers


def _hybrid_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Linear or full attention per layer: layer_types, else every full_attention_interval-th layer is full."""
    if cfg.get("layer_types") is None:
        interval = cfg.get("full_attention_interval", 4)
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    types = tuple(cfg["layer_types"])
    unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if len(types) != num_layers or unknown:
        raise ValueError(f"layer_types must give {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r} for each of the "
                         f"{num_layers} layers; got {len(types)} entries{f', unknown {unknown}' if unknown else ''}")
    if FULL_ATTENTION not in types:
        raise ValueError("a hybrid model needs at least one full_attention layer (the paged KV cache holds them)")
    return types


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    # Qwen2 configs carry a window but switch it off with use_sliding_window=false
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return None
    return int(cfg["sliding_window"])


def _architecture(cfg: dict[str, Any]) -> str:
    names = cfg.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise ValueError(
        f"model architecture {names or model_type!r} is not supported; kvserve runs {sorted(SUPPORTED_ARCHITECTURES)}"
    )
