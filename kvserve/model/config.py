"""The few facts of an HF config.json that the forward pass needs (Llama family and Gemma 3)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Gemma 3's defaults when its config leaves them out (transformers' Gemma3TextConfig)
GEMMA3_ROPE_THETA = 1_000_000.0
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # five sliding-window layers, then one full-attention layer
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256


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
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = _architecture(cfg)
        heads = cfg["num_attention_heads"]
        full_rope, sliding_rope = _rope_by_layer_type(cfg, arch)
        rope_theta, rope_scaling = _rope(full_rope)
        eos = cfg.get("eos_token_id")
        sliding_window = _sliding_window(cfg)
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3_text"),
            layer_types=_layer_types(cfg, arch, cfg["num_hidden_layers"], sliding_window),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            sliding_window=sliding_window,
            **(_gemma3_fields(cfg, sliding_rope) if arch == "gemma3_text" else {}),
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


def _rope(params: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one layer type's RoPE parameters; scaling is None for plain RoPE."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)} are)")
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


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int, sliding_window: int | None) -> tuple[str, ...]:
    """Each layer's attention: from layer_types, Gemma's interleave pattern, or the window's presence."""
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
