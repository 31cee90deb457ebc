"""Turn a model argument (the embedded name, an HF directory or a GGUF file) into an HF-style directory."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvserve.model.chat_templates import fallback_chat_template
from kvserve.model.embedded import EMBEDDED_MODEL_NAME, default_cache_dir, embedded_gguf_path
from kvserve.model.gemma_package import GEMMA_ALIASES, GEMMA_MODEL_NAME, gemma_gguf_path

EMBEDDED_ALIASES = frozenset({EMBEDDED_MODEL_NAME, "smollm2-135m-instruct"})
GGUF_MAGIC = b"GGUF"
# Bump when the conversion output changes, so caches written by older code are not reused.
CONVERSION_VERSION = 2
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>")  # ChatML's, Gemma's


@dataclass(frozen=True)
class ModelSource:
    """A served model name and the HF-style directory holding its config, safetensors and tokenizer."""

    name: str
    path: Path


def resolve_model(model: str | None = None, cache_dir: str | Path | None = None) -> ModelSource:
    """Find or build the HF-style directory for `model`; a GGUF file is converted once into the cache."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model is None or model.lower() in EMBEDDED_ALIASES:
        return ModelSource(EMBEDDED_MODEL_NAME, _converted(embedded_gguf_path(cache), cache))
    if model.lower() in GEMMA_ALIASES:
        return ModelSource(GEMMA_MODEL_NAME, _converted(gemma_gguf_path(cache), cache))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; expected an HF model directory "
                "(config.json, *.safetensors, tokenizer files)"
            )
        return ModelSource(path.resolve().name, path)
    if path.is_file():
        _check_gguf(path)
        return ModelSource(path.stem, _converted(path, cache))
    raise FileNotFoundError(
        f"model {model!r}: {path} does not exist; expected {EMBEDDED_MODEL_NAME!r}, "
        "an HF model directory with config.json, or a .gguf file"
    )


def load_weights(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All safetensors weights of an HF directory (sharded or not), cast to `dtype`, names unchanged."""
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path)):
        for name, tensor in load_file(file).items():
            weights[name] = tensor.to(dtype)
    return weights


def _safetensors_files(path: Path) -> list[Path]:
    # A sharded checkpoint's index names its shards; trust it over a glob that could pick up strays.
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}; expected an HF model directory")
    return files


def _check_gguf(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r}); "
            f"expected {EMBEDDED_MODEL_NAME!r}, an HF model directory with config.json, or a .gguf file"
        )


def _cache_key(gguf: Path) -> str:
    # Size and mtime change whenever the file is rewritten; hashing gigabytes on every start would not pay.
    stat = gguf.stat()
    ident = f"{CONVERSION_VERSION}\0{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _converted(gguf: Path, cache: Path) -> Path:
    """The cached HF directory for `gguf`, converting it first if no finished copy exists."""
    target = cache / f"{gguf.stem}-{_cache_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Build in a temp dir beside the target and rename it into place, so the target is always complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache))
    try:
        _announce(gguf, target)
        start_s = time.perf_counter()
        _convert(gguf, tmp)
        _publish(tmp, target)
        print(f"Converted in {time.perf_counter() - start_s:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    try:
        tmp.rename(target)
    except OSError:
        # Another process finished the same conversion first: its copy is as good as ours.
        if not (target / "config.json").is_file():
            raise


def _announce(gguf: Path, target: Path) -> None:
    home = Path.home()
    shown = f"~/{target.relative_to(home)}" if target.is_relative_to(home) else str(target)
    print(f"Converting {gguf.name} to safetensors in {shown} (once, 20 s to a few minutes)", file=sys.stderr)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers and save it as an HF directory with fp32 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow import, only needed here

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are already plain fp32 after dequantization; without this, save_pretrained
    # would record a GGUF quantization config that the saved safetensors do not match.
    model.hf_quantizer = None
    del model.config.quantization_config
    tokenizer.chat_template = tokenizer.chat_template or fallback_chat_template(model.config.model_type)
    model.generation_config.eos_token_id = _eos_token_ids(model.config.eos_token_id, tokenizer)
    # The GGUF tokenizer comes with an unbounded max length; the model's context is the real limit.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _eos_token_ids(config_eos: int | list[int] | None, tokenizer) -> int | list[int] | None:
    """The GGUF's EOS ids plus the template's end-of-turn token (ChatML's or Gemma's), so chat replies stop."""
    ids = [i for i in (config_eos if isinstance(config_eos, list) else [config_eos]) if i is not None]
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in (tokenizer.chat_template or "")]
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else (ids or None)
