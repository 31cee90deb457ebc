"""Random-weight hybrid (Gated DeltaNet) models for the benches: a `Qwen3_5ForCausalLM` directory (config.json +
bfloat16 safetensors, no tokenizer: the benches send token ids) built from transformers' `Qwen3_5TextConfig` with a
fixed seed, once, into kvserve's cache, and reused.

`qwen3.5-0.8b-random` has the released Qwen3.5-0.8B's text model's shape (24 layers, three Gated DeltaNet layers
then one gated full-attention layer, six times; hidden 1,024, MLP 3,584; attention 8 query and 2 KV heads of 256;
DeltaNet 16 key and 16 value heads of 128; vocabulary 248,320, tied embeddings) without its vision tower and MTP
layer; `qwen3.5-0.8b-random-12l` is the same with 12 layers (3 of them full attention), for machines where the full
size is too slow, and `qwen3.5-tiny-random` keeps the pattern in 4 layers of width 128 (vocabulary 8,192): what a
conversation prefills with prefix caching depends on block boundaries and checkpoints, not on the width, and it
decodes the seed's long conversation in minutes. No released checkpoint is small enough for the package index; the
benches count tokens and time steps, which do not depend on the weights' values (EOS is ignored)."""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

# the released Qwen3.5-0.8B's text config as its model card and published configs give it; eos_token_id is Qwen3.5's
# <|im_end|> (the benches ignore EOS)
QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, eos_token_id=248046,
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
HYBRID_MODELS = {
    "qwen3.5-0.8b-random": QWEN35_08B,
    "qwen3.5-0.8b-random-12l": {**QWEN35_08B, "num_hidden_layers": 12},
    "qwen3.5-tiny-random": {**QWEN35_08B, **dict(vocab_size=8192, hidden_size=128, intermediate_size=448,
                                                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4,
                                                 linear_key_head_dim=32, linear_value_head_dim=32, eos_token_id=2)},
}
BUILD_VERSION = 1  # bump when the build changes, so directories built by older code are not reused


def build_hybrid_model(directory: str | Path, config: dict, seed: int = 0) -> Path:
    """Save a random Qwen3.5 text model of `config` (transformers' initialisation under `seed`, stored in bfloat16)
    as an HF directory: the same seed and config give the same bytes."""
    import torch
    import transformers

    layers = config["num_hidden_layers"]
    if layers % 4:
        raise ValueError(f"num_hidden_layers={layers}: the Qwen3.5 pattern (3 linear, 1 full) needs a multiple of 4")
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config, layer_types=types))
    model.to(torch.bfloat16).save_pretrained(directory)
    return Path(directory)


def hybrid_model_path(name: str, seed: int = 0, cache_dir: str | Path | None = None, console=None) -> Path:
    """The cached directory of HYBRID_MODELS[name] under `seed`, built on first use (into a temporary directory
    renamed into place, so an interrupted build leaves nothing behind)."""
    from kvserve.model.embedded import default_cache_dir

    if name not in HYBRID_MODELS:
        raise ValueError(f"unknown hybrid model {name!r}; choose one of {', '.join(HYBRID_MODELS)}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / "bench" / f"{name}-seed{seed}-v{BUILD_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if console is not None:
        console.print(f"building the random {name} (seed {seed}) into {target} (once)", soft_wrap=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_hybrid_model(tmp, HYBRID_MODELS[name], seed)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of a shared cache
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def describe_hybrid_model(path: str | Path) -> str:
    """One line: the directory's layers, width, DeltaNet heads and vocabulary, labelled random weights."""
    c = json.loads((Path(path) / "config.json").read_text())
    full = c["layer_types"].count("full_attention")
    return (f"{Path(path).name}: random weights (bfloat16 on disk), {c['num_hidden_layers']} layers "
            f"({c['num_hidden_layers'] - full} Gated DeltaNet, {full} full attention), hidden {c['hidden_size']:,}, "
            f"DeltaNet {c['linear_num_value_heads']} value heads of {c['linear_value_head_dim']}, vocabulary "
            f"{c['vocab_size']:,}")


def add_hybrid_model_argument(parser) -> None:
    parser.add_argument("--hybrid-model", choices=sorted(HYBRID_MODELS), metavar="NAME",
                        help=f"run on a random-weight hybrid (Gated DeltaNet) model built once into the cache: "
                             f"{', '.join(HYBRID_MODELS)} (instead of --model)")


def resolve_hybrid_model_argument(args: argparse.Namespace, console=None) -> None:
    """With --hybrid-model, build or find the model and put its directory in args.model."""
    if not getattr(args, "hybrid_model", None):
        return
    if args.model:
        raise SystemExit("--hybrid-model and --model name two models; give one")
    path = hybrid_model_path(args.hybrid_model, console=console)
    args.model = str(path)
    if console is not None:
        console.print(describe_hybrid_model(path), highlight=False, soft_wrap=True)
