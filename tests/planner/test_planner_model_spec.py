"""ModelSpec from presets, HF configs, model directories and GGUF files; bad input is refused clearly."""
import json

import pytest

from kvserve.model.embedded import embedded_gguf_path
from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype
from kvserve.planner.loaders import load_model_spec, load_preset_config, preset_names
from kvserve.planner.model_spec import FULL, LINEAR, SLIDING, ModelSpec
from kvserve.planner.parameters import estimate_num_parameters

REQUIRED_PRESETS = {
    "llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b-v0.1", "qwen3-8b",
    "gemma-3-27b", "deepseek-v2-lite", "smollm2-135m", "qwen3-next-80b-a3b", "qwen3.6-35b-a3b",
    "qwen3.6-seed-example",
}

# (layers, query heads, KV heads, head_dim, max length, attention kind) as the models publish them
PRESET_GEOMETRY = {
    "llama-3.1-8b": (32, 32, 8, 128, 131_072, "GQA"),
    "llama-3.1-70b": (80, 64, 8, 128, 131_072, "GQA"),
    "llama-3.2-1b": (16, 32, 8, 64, 131_072, "GQA"),
    "qwen2.5-7b": (28, 28, 4, 128, 131_072, "GQA"),
    "mistral-7b-v0.1": (32, 32, 8, 128, 32_768, "GQA"),
    "qwen3-8b": (36, 32, 8, 128, 40_960, "GQA"),
    "gemma-3-27b": (62, 32, 16, 128, 131_072, "GQA"),
    "deepseek-v2-lite": (27, 16, 16, 128, 163_840, "MLA"),
    "smollm2-135m": (30, 9, 3, 64, 8_192, "GQA"),
    "qwen3-next-80b-a3b": (48, 16, 2, 256, 262_144, "GQA"),
    "qwen3.6-35b-a3b": (40, 16, 2, 256, 262_144, "GQA"),
    "qwen3.6-seed-example": (40, 16, 8, 128, 262_144, "GQA"),  # the seed article's simplified KV heads
}

# parameter counts published for the dense models, which the planner computes from their configs
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b-v0.1": 7_241_732_096,
    "smollm2-135m": 134_515_008,
}


def test_every_required_preset_ships():
    assert REQUIRED_PRESETS <= set(preset_names())


@pytest.mark.parametrize("name", sorted(PRESET_GEOMETRY))
def test_preset_geometry_matches_the_published_config(name):
    spec = load_model_spec(name)
    layers, heads, kv_heads, head_dim, max_len, kind = PRESET_GEOMETRY[name]
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads) == (layers, heads, kv_heads)
    assert (spec.head_dim, spec.max_position_embeddings, spec.attention_kind) == (head_dim, max_len, kind)
    assert len(spec.layer_kinds) == layers


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_dense_parameter_counts_computed_from_config(name):
    assert load_model_spec(name).num_parameters == PUBLISHED_PARAMETERS[name]


def test_qwen3_8b_parameters_include_its_qk_norms():
    assert round(load_model_spec("qwen3-8b").num_parameters / 1e9, 2) == 8.19


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "gemma-3-27b"])
def test_stated_parameter_counts_agree_with_the_config(name):
    config = load_preset_config(name)
    estimate = estimate_num_parameters(config.get("text_config", config))
    # Gemma 3's stated count also holds its ~0.4B-parameter vision tower, which the text config lacks
    assert 0.98 < estimate / config["num_parameters"] <= 1.0


def test_hybrid_preset_needs_a_stated_parameter_count():
    config = load_preset_config("qwen3-next-80b-a3b")
    assert estimate_num_parameters(config) is None
    assert load_model_spec("qwen3-next-80b-a3b").num_parameters == config["num_parameters"]


def test_layer_kinds_of_the_presets():
    assert set(load_model_spec("llama-3.1-8b").layer_kinds) == {FULL}
    assert set(load_model_spec("qwen2.5-7b").layer_kinds) == {FULL}  # use_sliding_window is false
    assert load_model_spec("qwen2.5-7b").sliding_window is None
    assert set(load_model_spec("mistral-7b-v0.1").layer_kinds) == {SLIDING}
    gemma = load_model_spec("gemma-3-27b").layer_kinds
    assert gemma.count(FULL) == 10 and gemma[5] == FULL and gemma[:5] == (SLIDING,) * 5
    next_kinds = load_model_spec("qwen3-next-80b-a3b").layer_kinds
    assert next_kinds[:4] == (LINEAR, LINEAR, LINEAR, FULL)


def test_multimodal_config_is_read_through_text_config():
    spec = load_model_spec("gemma-3-27b")
    assert spec.hidden_size == 5376 and spec.model_type == "gemma3_text"
    assert spec.torch_dtype == "bfloat16"


def test_gguf_metadata_of_the_embedded_smollm2(embedded_spec):
    preset = load_model_spec("smollm2-135m")
    assert embedded_spec.model_type == "llama"
    for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
                  "vocab_size", "max_position_embeddings", "layer_kinds", "num_parameters"):
        assert getattr(embedded_spec, field) == getattr(preset, field), field
    fp16 = resolve_kv_dtype("fp16", preset)
    assert kv_bytes_per_token(embedded_spec, fp16) == kv_bytes_per_token(preset, fp16) == 2 * 30 * 3 * 64 * 2
    # Q4_1 weights: ~0.72 bytes per parameter overall (embeddings and norms stay wider)
    assert 90_000_000 < embedded_spec.weights_bytes < 100_000_000


def test_config_json_file_and_model_directory(tmp_path):
    config = load_preset_config("llama-3.2-1b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = load_model_spec(str(tmp_path))
    from_file = load_model_spec(str(tmp_path / "config.json"))
    assert from_dir == from_file
    assert from_dir.num_parameters == 1_235_814_400
    assert from_dir.name == tmp_path.name


def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="unknown model 'llama-9'.*llama-3.1-8b"):
        load_model_spec("llama-9")
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset_config("../presets/llama-3.1-8b")


def test_malformed_config_file_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid config.json"):
        load_model_spec(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        load_model_spec(str(path))


def test_directory_without_a_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a config.json nor a single .gguf"):
        load_model_spec(str(tmp_path))


def test_truncated_gguf_is_refused(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model_spec(str(path))


def test_missing_required_field_is_named():
    with pytest.raises(ValueError, match="missing num_attention_heads"):
        ModelSpec.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64, "max_position_embeddings": 128})


@pytest.mark.parametrize("key, value", [("num_hidden_layers", -2), ("hidden_size", "big"), ("head_dim", 0)])
def test_non_positive_or_non_integer_fields_are_refused(key, value):
    config = {**load_preset_config("smollm2-135m"), key: value}
    with pytest.raises(ValueError, match=f"{key} must be a positive integer"):
        ModelSpec.from_hf_config(config, name="smol")


def test_layer_types_must_cover_every_layer_with_known_types():
    config = load_preset_config("smollm2-135m")
    with pytest.raises(ValueError, match="one type per layer"):
        ModelSpec.from_hf_config({**config, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ValueError, match="unknown layer types"):
        ModelSpec.from_hf_config({**config, "layer_types": ["warp_attention"] * 30})


def test_sliding_layers_need_a_window():
    config = {**load_preset_config("smollm2-135m"), "layer_types": ["sliding_attention"] * 30}
    with pytest.raises(ValueError, match="missing sliding_window"):
        ModelSpec.from_hf_config(config)


@pytest.fixture(scope="module")
def embedded_spec() -> ModelSpec:
    return load_model_spec(str(embedded_gguf_path()))
