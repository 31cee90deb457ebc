"""ModelConfig from config.json: Gemma 3 in both the older and the transformers-5 spelling gives the same layer
pattern and RoPE per layer type; unsupported variants fail with the reason."""
import pytest
import transformers

from kvserve.model.config import ModelConfig

GEMMA3_4B_STYLE = {  # the older spelling, as google/gemma-3-*-it text configs were published
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
    "intermediate_size": 10240, "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "vocab_size": 262208, "query_pre_attn_scalar": 256, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 1024, "sliding_window_pattern": 6, "final_logit_softcapping": None, "tie_word_embeddings": True,
}
SLIDING, FULL = "sliding_attention", "full_attention"


def test_older_gemma3_config():
    cfg = ModelConfig.from_hf(GEMMA3_4B_STYLE)
    assert cfg.architecture == "gemma3_text"
    assert cfg.layer_types == ((SLIDING,) * 5 + (FULL,)) * 2
    assert cfg.sliding_window == 1024
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (1e6, "linear", 8.0)
    assert (cfg.sliding_rope_theta, cfg.sliding_rope_scaling) == (1e4, None)  # scaling is the global layers' only
    assert cfg.query_pre_attn_scalar == 256 and cfg.qk_norm and cfg.tie_word_embeddings


def test_transformers5_gemma3_config_reads_the_same():
    text = transformers.Gemma3TextConfig(
        num_hidden_layers=12, sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0},
    ).to_dict()
    text["architectures"] = ["Gemma3ForCausalLM"]
    cfg, older = ModelConfig.from_hf(text), ModelConfig.from_hf(GEMMA3_4B_STYLE)
    for field in ("layer_types", "sliding_window", "rope_theta", "sliding_rope_theta", "sliding_rope_scaling",
                  "query_pre_attn_scalar", "final_logit_softcapping", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(older, field), field
    assert (cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == ("linear", 8.0)


def test_gemma3_defaults_when_the_config_is_silent():
    bare = {key: GEMMA3_4B_STYLE[key] for key in ("model_type", "hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "num_attention_heads", "vocab_size")}
    cfg = ModelConfig.from_hf({**bare, "sliding_window": 512})
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert cfg.layer_types == ((SLIDING,) * 5 + (FULL,)) * 2


def test_other_families_get_uniform_layer_types():
    llama = transformers.LlamaConfig(num_hidden_layers=3).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=64).to_dict()
    qwen2 = transformers.Qwen2Config(num_hidden_layers=3).to_dict()  # carries a window it switches off
    assert ModelConfig.from_hf(llama).layer_types == (FULL,) * 3
    assert ModelConfig.from_hf(mistral).layer_types == (SLIDING,) * 3
    assert ModelConfig.from_hf(qwen2).layer_types == (FULL,) * 3
    assert ModelConfig.from_hf(llama).sliding_rope_theta is None


def test_multimodal_gemma3_is_refused_by_name():
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*not supported.*Gemma3ForCausalLM"):
        ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                             "text_config": GEMMA3_4B_STYLE})


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": True}, "embedding model"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
    ({"layer_types": [SLIDING] * 11}, "each of the 12 layers; got 11"),
    ({"layer_types": ["chunked_attention"] * 12}, "unknown \\['chunked_attention'\\]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
])
def test_unsupported_gemma3_variants_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**GEMMA3_4B_STYLE, **change})


def test_a_dense_config_without_the_mlp_width_is_refused_by_name():
    # only a MoE config that routes every layer (Qwen3.5/3.6 MoE) may leave intermediate_size out
    dense = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 10}
    with pytest.raises(ValueError, match="no intermediate_size"):
        ModelConfig.from_hf(dense)
