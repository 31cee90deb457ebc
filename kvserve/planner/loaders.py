"""Turn a MODEL argument into a ModelSpec: a preset name, a config.json, a model directory or a GGUF file."""
from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any

from kvserve.planner.model_spec import ModelSpec

_PRESETS = resources.files("kvserve.planner") / "presets"
_GGUF_MAGIC = b"GGUF"
# GGUF leaves the local/global interleave of these architectures to llama.cpp's code
_GGUF_SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6}


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in _PRESETS.iterdir() if p.name.endswith(".json"))


def load_preset_config(name: str) -> dict:
    """The stored config.json fields of a built-in preset."""
    if name.lower() not in preset_names():
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return json.loads((_PRESETS / f"{name.lower()}.json").read_text())


def load_model_spec(source: str) -> ModelSpec:
    """Spec for a preset name, an HF config.json, a directory holding one, or a GGUF file."""
    path = Path(source)
    if path.is_dir():
        return _spec_from_directory(path)
    if path.is_file():
        return _spec_from_gguf(path) if _is_gguf(path) else _spec_from_config_file(path, path.parent.name)
    if source.lower() in preset_names():
        return ModelSpec.from_hf_config(load_preset_config(source), name=source.lower())
    raise ValueError(
        f"unknown model {source!r}: not an existing file or directory, nor a preset "
        f"({', '.join(preset_names())})"
    )


def _spec_from_directory(path: Path) -> ModelSpec:
    if (path / "config.json").is_file():
        return _spec_from_config_file(path / "config.json", path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _spec_from_gguf(ggufs[0])
    raise ValueError(f"{path} holds neither a config.json nor a single .gguf file")


def _spec_from_config_file(path: Path, name: str) -> ModelSpec:
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a valid config.json: {exc}") from exc
    return ModelSpec.from_hf_config(config, name=name or path.stem)


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _spec_from_gguf(path: Path) -> ModelSpec:
    """Read the model's metadata and tensor sizes from a GGUF file (no weights are loaded)."""
    from gguf import GGUFReader  # imported here: only GGUF inputs pay for it

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    config = gguf_to_hf_config({key: _field_value(field) for key, field in reader.fields.items()
                                if not key.startswith("tokenizer.ggml.")})
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in reader.fields:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    config["num_parameters"] = sum(int(t.n_elements) for t in reader.tensors)
    spec = ModelSpec.from_hf_config(config, name=path.stem)
    return dataclasses.replace(spec, weights_bytes=sum(int(t.n_bytes) for t in reader.tensors))


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value.tolist() if hasattr(value, "tolist") else value


def gguf_to_hf_config(metadata: dict) -> dict:
    """HF config fields from GGUF metadata keys (`{arch}.block_count`, `{arch}.attention.head_count`, ...)."""
    arch = metadata.get("general.architecture")
    if not arch:
        raise ValueError("GGUF metadata has no general.architecture")

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    config = {
        "model_type": arch,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "max_position_embeddings": get("context_length"),
        "head_dim": get("attention.key_length"),
        "vocab_size": get("vocab_size"),
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": _GGUF_SLIDING_PATTERNS.get(arch),
        # llama.cpp caches K and V in f16 unless told otherwise
        "torch_dtype": "float16",
    }
    kv_heads = get("attention.head_count_kv")
    if isinstance(kv_heads, list):  # per-layer counts: 0 marks a layer without attention
        config["layer_types"] = ["full_attention" if n else "linear_attention" for n in kv_heads]
        kv_heads = max(kv_heads)
    config["num_key_value_heads"] = kv_heads
    if get("attention.kv_lora_rank"):
        config["kv_lora_rank"] = get("attention.kv_lora_rank")
        config["qk_rope_head_dim"] = get("rope.dimension_count")
    return {key: value for key, value in config.items() if value is not None}
