"""Tiny random-weight models built in the test from transformers' config classes: no download."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

# One thread: tiny models gain nothing from two, and a second OpenMP thread on a busy 2-core machine (the
# server tests run an engine thread beside the client) makes every op wait for it.
torch.set_num_threads(1)
# Engines run eager decode steps unless a test asks for compiled ones (compile_decode=True): compiled is the default
# for users (kvserve/config.py, CompileConfig), but the suite starts hundreds of engines whose models differ, each of
# which would compile at start. Set here, before any engine, so the servers the tests start as processes inherit it;
# tests/engine/test_compile_default.py checks the default itself with the variable removed.
os.environ["KVSERVE_EAGER_STEPS"] = "1"

TINY_KINDS = {
    "llama-mha": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama-gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "llama-mqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=1)),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64)),
    ),
    "mistral-gqa": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(num_key_value_heads=2)),
    "qwen2-gqa": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3-gqa": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
    # Gemma 3 270M's shape in small: MQA, head_dim above hidden/heads, a query_pre_attn_scalar apart from head_dim,
    # tied embeddings, a sliding then a full-attention layer with their two RoPE bases (10,000 and 1,000,000)
    "gemma3-mqa": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, tie_word_embeddings=True,
             sliding_window=512, layer_types=["sliding_attention", "full_attention"]),
    ),
    # the larger Gemma 3s' extras: linear RoPE scaling on full-attention layers only, a 2:1 interleave from
    # sliding_window_pattern, GQA, untied head, and final logit softcapping (low, so it bends the logits)
    "gemma3-gqa-scaled": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window_pattern=3, sliding_window=512,
             final_logit_softcapping=2.0,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    ),
}


def make_tiny_chat_model(directory: Path, **overrides) -> Path:
    """A tiny random model that speaks SmolLM2's vocabulary and chat template (the embedded model's tokenizer)."""
    make_tiny_model(directory, vocab_size=49152, **overrides)
    return add_chat_tokenizer(directory)


def add_chat_tokenizer(directory: Path) -> Path:
    """Give a model directory of SmolLM2's vocabulary size the embedded model's tokenizer and chat template."""
    from kvserve.model.loader import resolve_model

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve_model(None).path / name, Path(directory) / name)
    return Path(directory)


def scrape_metrics(url: str, model_name: str) -> dict[str, float]:
    """/metrics of a running server as {name{labels}: value}, the model_name label left out."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvserve:"):
            name, value = line.rsplit(" ", 1)
            values[name.replace(f'model_name="{model_name}"', "").replace("{,", "{").replace(",}", "}")
                   .removesuffix("{}")] = float(value)
    return values


def make_tiny_model(directory: Path, kind: str = "llama-gqa", seed: int = 0, **overrides) -> Path:
    """Save a 2-layer random model (vocab 256, hidden 64, 4 heads) as an HF directory and return it."""
    config_cls, model_cls, extra = TINY_KINDS[kind]
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    fields.update(extra)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    if config_cls is transformers.Gemma3TextConfig:
        _randomize_norms(model)
    model.save_pretrained(directory)
    return directory


def _randomize_norms(model: torch.nn.Module) -> None:
    # Gemma stores each RMSNorm scale as w in (1 + w), initialised to 0: random w makes a wrong offset show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)


CHAR_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, matching the tiny models' bos=1, eos=2


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A 256-token tokenizer, one token per character, for the tiny models (vocab 256)."""
    chars = ["\n"] + [chr(c) for c in range(32, 127)] + [chr(c) for c in range(161, 256)]
    chars += [chr(c) for c in range(0x391, 0x391 + 256 - len(CHAR_SPECIALS) - len(chars))]  # Greek
    vocab = {token: i for i, token in enumerate(CHAR_SPECIALS + chars)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def save_char_tokenizer(directory: Path) -> Path:
    """Add the char tokenizer to a tiny model directory so the engine takes text prompts and stop strings."""
    char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(autouse=True, scope="session")
def session_graph_directory(tmp_path_factory):
    """Compiled decode graphs that engines built by module-scoped fixtures save: this run's, not the machine's
    Inductor cache directory's (own_graph_directory gives each test its own)."""
    from kvserve import saved_graphs

    with pytest.MonkeyPatch.context() as patch:
        directory = tmp_path_factory.mktemp("graphs")
        patch.setattr(saved_graphs, "graph_directory", lambda: directory)
        yield


@pytest.fixture(autouse=True, scope="session")
def session_route_file(tmp_path_factory):
    """The matmul routes the probes remember (model/route_cache.py): this run's file, not the machine's."""
    from kvserve.model import route_cache

    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("routes") / route_cache.FILE_NAME
        patch.setattr(route_cache, "route_file", lambda: path)
        yield


@pytest.fixture(autouse=True)
def own_graph_directory(monkeypatch, tmp_path):
    """Each test saves and loads compiled decode graphs in a directory of its own (kvserve/saved_graphs.py): a graph
    traced under one test's monkeypatches is never loaded by another's engine. (Inductor's kernel cache stays
    shared: it is keyed by the generated code itself.)"""
    from kvserve import saved_graphs

    monkeypatch.setattr(saved_graphs, "graph_directory", lambda: tmp_path / saved_graphs.DIRECTORY_NAME)


@pytest.fixture(autouse=True)
def no_leaked_blocks(monkeypatch):
    """After every test, every engine it built has all its blocks back in the pool (free or cached-free),
    unless the test left requests unfinished on purpose."""
    from kvserve.engine.llm_engine import LLMEngine

    engines = []  # each engine's requests and pool, not the engine: a test may check that a dropped engine is freed
    original_init = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        engines.append((self.requests, self.kv.pool))

    monkeypatch.setattr(LLMEngine, "__init__", tracking_init)
    yield
    for requests, pool in engines:
        if not requests:
            assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked after the last request finished"
            assert all(block.ref_cnt == 0 for block in pool.blocks)


def image_size(path: Path) -> tuple[str, float, float]:
    """(format, width, height) of a PNG (pixels) or SVG (points) file, read from the file itself."""
    import xml.etree.ElementTree as ElementTree

    from PIL import Image

    if path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n":
        with Image.open(path) as image:
            return "png", *image.size
    root = ElementTree.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg", f"{path} is neither PNG nor SVG"
    return "svg", float(root.get("width").removesuffix("pt")), float(root.get("height").removesuffix("pt"))


def serve_tiny(model_dir: Path, engine_options: dict, **app_options):
    """A ServerThread over a new engine for `model_dir`; `app_options` go to build_app, except "engine", whose
    options override `engine_options`."""
    from kvserve import EngineConfig, LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.launch import ServerThread

    engine = LLMEngine(EngineConfig(model=str(model_dir), **{**engine_options, **app_options.pop("engine", {})}))
    return ServerThread(build_app(engine, **app_options))


def fail_at_token(monkeypatch, position: int) -> None:
    """Fault injection: a request whose stop strings include "BOOM" raises when its detokenizer takes token
    `position` (1: the first)."""
    from kvserve.engine.detokenizer import Detokenizer

    update = Detokenizer.update

    def failing_update(self, token_ids):
        if "BOOM" in self.stop and len(token_ids) == position:
            raise RuntimeError(f"injected fault at token {position}")
        update(self, token_ids)

    monkeypatch.setattr(Detokenizer, "update", failing_update)
