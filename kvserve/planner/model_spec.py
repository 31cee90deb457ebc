"""ModelSpec: the few numbers of a model's config that decide its KV cache and weight sizes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.planner.parameters import estimate_num_parameters

FULL = "full"  # attention over every earlier token: grows with the request
SLIDING = "sliding"  # attention over the last `sliding_window` tokens: stops growing at the window
LINEAR = "linear"  # linear attention / SSM: a fixed-size state per request, no per-token KV

# layer_types spellings used by transformers configs, mapped onto the three kinds above
_LAYER_TYPES = {
    "full_attention": FULL,
    "attention": FULL,
    "sliding_attention": SLIDING,
    "linear_attention": LINEAR,
    "mamba": LINEAR,
    "mamba2": LINEAR,
}

# architectures whose configs give a sliding window but leave the local/global interleave to the code
_SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


@dataclass(frozen=True)
class ModelSpec:
    """Attention geometry, length and size of one model, read from an HF config, a GGUF file or a preset."""

    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    kv_lora_rank: int | None = None  # MLA: the compressed latent cached instead of K and V
    qk_rope_head_dim: int | None = None  # MLA: the decoupled RoPE key cached beside the latent
    qk_nope_head_dim: int | None = None  # MLA: per-head key part expanded from the latent (not cached)
    v_head_dim: int | None = None  # MLA: per-head value expanded from the latent (not cached)
    linear_state_elements: int | None = None  # per linear-attention layer, when the config gives the sizes
    num_parameters: int | None = None
    weights_bytes: int | None = None  # stored size when the file tells it (GGUF), else None

    @classmethod
    def from_hf_config(cls, config: dict, name: str | None = None) -> ModelSpec:
        """Spec from a config.json dict; multimodal configs are read through their text_config."""
        if not isinstance(config, dict):
            raise ValueError(f"model config must be a JSON object, got {type(config).__name__}")
        text = _text_config(config)
        name = name or str(config.get("_name_or_path") or text.get("model_type") or "model")
        num_layers = _positive_int(text, "num_hidden_layers", name)
        num_heads = _positive_int(text, "num_attention_heads", name)
        hidden_size = _positive_int(text, "hidden_size", name)
        kv_lora_rank = _optional_int(text, "kv_lora_rank", name)
        layer_kinds = _layer_kinds(text, num_layers, name)
        return cls(
            name=name,
            model_type=str(text.get("model_type", "unknown")),
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=_optional_int(text, "num_key_value_heads", name) or num_heads,
            head_dim=_optional_int(text, "head_dim", name) or hidden_size // num_heads,
            hidden_size=hidden_size,
            vocab_size=_optional_int(text, "vocab_size", name) or 0,
            max_position_embeddings=_positive_int(text, "max_position_embeddings", name),
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
            layer_kinds=layer_kinds,
            # Qwen2-style configs carry a window they never use: keep it only where a layer slides
            sliding_window=_positive_int(text, "sliding_window", name) if SLIDING in layer_kinds else None,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=_optional_int(text, "qk_rope_head_dim", name) if kv_lora_rank else None,
            qk_nope_head_dim=_optional_int(text, "qk_nope_head_dim", name) if kv_lora_rank else None,
            v_head_dim=_optional_int(text, "v_head_dim", name) if kv_lora_rank else None,
            linear_state_elements=_linear_state_elements(text),
            num_parameters=_optional_int(text, "num_parameters", name) or estimate_num_parameters(text),
        )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_kind(self) -> str:
        """MLA, MHA (one KV head per query head), MQA (one KV head) or GQA (groups in between)."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def kv_vectors_per_layer(self) -> int:
        """Vectors one token stores per layer: one K and one V per KV head, or MLA's single latent."""
        return 1 if self.is_mla else 2 * self.num_kv_heads

    @property
    def kv_vector_elements(self) -> int:
        return self.kv_lora_rank + (self.qk_rope_head_dim or 0) if self.is_mla else self.head_dim

    def num_layers_of(self, kind: str) -> int:
        return self.layer_kinds.count(kind)

    @property
    def num_kv_layers(self) -> int:
        """Layers that hold per-token KV (full and sliding attention)."""
        return self.num_layers_of(FULL) + self.num_layers_of(SLIDING)


def _text_config(config: dict) -> dict:
    """Multimodal configs nest the language model; size-wide fields stay at the top level."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    top = {key: config[key] for key in ("num_parameters", "torch_dtype", "dtype") if key in config}
    return {**top, **text}


def _positive_int(config: dict, key: str, name: str) -> int:
    value = _optional_int(config, key, name)
    if value is None:
        raise ValueError(f"config of {name} is missing {key}")
    return value


def _optional_int(config: dict, key: str, name: str) -> int | None:
    value: Any = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise ValueError(f"config of {name}: {key} must be a positive integer, got {value!r}")
    return int(value)


def _layer_kinds(config: dict, num_layers: int, name: str) -> tuple[str, ...]:
    """Per-layer attention kind from layer_types, a full-attention interval, or the sliding-window fields."""
    if config.get("layer_types") is not None:
        return _kinds_from_layer_types(config["layer_types"], num_layers, name)
    if config.get("full_attention_interval"):
        interval = int(config["full_attention_interval"])
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    if not config.get("sliding_window") or config.get("use_sliding_window") is False:
        return (FULL,) * num_layers
    pattern = config.get("sliding_window_pattern") or _SLIDING_PATTERNS.get(str(config.get("model_type")))
    if pattern:
        return tuple(SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers))
    if config.get("use_sliding_window") and "max_window_layers" in config:
        # Qwen2-style: the bottom max_window_layers layers keep full attention
        return tuple(SLIDING if i >= config["max_window_layers"] else FULL for i in range(num_layers))
    return (SLIDING,) * num_layers


def _kinds_from_layer_types(layer_types: Any, num_layers: int, name: str) -> tuple[str, ...]:
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"config of {name}: layer_types must list one type per layer ({num_layers})")
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(f"config of {name}: unknown layer types {unknown}; known: {sorted(_LAYER_TYPES)}")
    return tuple(_LAYER_TYPES[t] for t in layer_types)


def _linear_state_elements(config: dict) -> int | None:
    """Gated DeltaNet state per layer (Qwen3-Next style): recurrent matrix per value head plus conv tail."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")
    if not all(config.get(key) for key in keys):
        return None
    key_heads, value_heads, key_dim, value_dim, kernel = (int(config[key]) for key in keys)
    recurrent = value_heads * key_dim * value_dim
    conv = (kernel - 1) * (2 * key_heads * key_dim + value_heads * value_dim)  # over q, k and v channels
    return recurrent + conv
