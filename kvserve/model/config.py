"""The few facts of an HF config.json that the Llama-family forward pass needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


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
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # set only when the config turns sliding-window attention on
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = _architecture(cfg)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3 are)")
        eos = cfg.get("eos_token_id")
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
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            sliding_window=_sliding_window(cfg),
            hf_config=dict(cfg),
        )


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
