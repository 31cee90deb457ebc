"""`kvserve plan` for MLA models (DeepSeek-V2-Lite, DeepSeek-V3): the cached latent, named, sized, and compared
with the per-head K and V it replaces."""
import pytest

from kvserve.cli import main
from kvserve.planner.kv_size import BF16, FP8_E4M3, expanded_kv_bytes_per_token, kv_bytes_per_token
from kvserve.planner.loaders import load_model_spec


@pytest.mark.parametrize("name, layers, heads, expanded", [
    ("deepseek-v2-lite", 27, 16, 276_480),  # 27 layers x 16 heads x (K 128 + 64 + V 128) x 2 B
    ("deepseek-v3", 61, 128, 4_997_120),
])
def test_latent_bytes_per_token_and_what_expanding_would_take(name, layers, heads, expanded):
    spec = load_model_spec(name)
    assert kv_bytes_per_token(spec, BF16) == layers * (512 + 64) * 2
    assert kv_bytes_per_token(spec, FP8_E4M3) == layers * (512 + 64 + 2)  # one 2-byte scale per latent vector
    assert expanded_kv_bytes_per_token(spec, BF16) == expanded == layers * heads * (128 + 64 + 128) * 2


def test_deepseek_v3_parameters_come_from_its_config():
    assert round(load_model_spec("deepseek-v3").num_parameters / 1e9, 2) == 671.03  # without the MTP module


def test_plan_names_the_latent(capsys):
    status = main(["plan", "deepseek-v2-lite", "--gpu", "h100-80"])
    out = capsys.readouterr().out
    assert status == 0
    assert "MLA: 16 query heads, latent 512 + rope 64 per token and layer, 27 layers" in out
    assert "27 layers × (512 kv_lora_rank + 64 qk_rope_head_dim) × 2 B (bf16) = 31,104 B" in out
    assert "would take 276,480 B/token, 8.9× as much" in out
    assert "KV cache (latent 512 + rope 64 per token and layer): 88,987 blocks × 16 tokens" in out
