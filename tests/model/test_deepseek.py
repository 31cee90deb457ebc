"""DeepSeek-V2/V3 (MLA + MoE) against transformers on the same random weights: logits at every prompt position and
20 greedy decode steps, float32, max abs diff <= 1e-4 — prefilled whole, chunked, batched and preempted, attention
expanded, absorbed and chosen by shape."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
import transformers

from kvserve import EngineConfig, LLMEngine, SamplingParams
from kvserve.model.config import ModelConfig
from tests.model.test_llama_matches_transformers import NUM_DECODE_STEPS, engine_logits

YARN_V2 = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=32, beta_slow=1,
               mscale=0.707, mscale_all_dim=0.707, rope_theta=10000.0)
YARN_V3 = dict(YARN_V2, mscale=1.0, mscale_all_dim=0.8)  # the rotated parts scaled too (factor != 1)
# Three layers: a dense first layer, then two MoE layers with shared experts; v_head_dim apart from the nope part.
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
              max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
DEEPSEEK_KINDS = {
    # V2-Lite's shape: no query LoRA, YaRN, greedy softmax routing, two shared experts
    "v2-lite": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                dict(q_lora_rank=None, n_shared_experts=2, rope_parameters=YARN_V2)),
    # V2's: query LoRA, group-limited routing (2 of 4 groups), plain RoPE
    "v2-groups": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                  dict(q_lora_rank=24, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4,
                       topk_group=2, routed_scaling_factor=1.5)),
    # V3's: query LoRA, YaRN, sigmoid routing with a choice bias over 1 of 2 groups, normalized weights
    "v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
           dict(q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1, rope_parameters=YARN_V3)),
    # V3 with rotate-half RoPE (rope_interleave=False) and no query LoRA
    "v3-halves": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                  dict(q_lora_rank=None, n_shared_experts=1, n_group=2, topk_group=1, rope_interleave=False)),
}


def make_deepseek(directory: Path, kind: str = "v3", seed: int = 0, **overrides) -> Path:
    """Save a tiny random DeepSeek model as an HF directory (checkpoint layout: one tensor set per expert)."""
    config_cls, model_cls, extra = DEEPSEEK_KINDS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides})).eval()
    with torch.no_grad():  # norms and the router's choice bias start at 1 and 0: random ones make mistakes show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


def hf_reference(path: Path, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits over prompt + tokens, and its own 20 greedy tokens after the prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE_STEPS, do_sample=False,
                                min_new_tokens=NUM_DECODE_STEPS)[0, len(prompt):].tolist()
    return logits, generated


def random_prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches(prompt_logits: torch.Tensor, step_logits: list[torch.Tensor], tokens: list[int],
                   reference: torch.Tensor, generated: list[int], prompt_len: int) -> None:
    assert (prompt_logits - reference[:prompt_len]).abs().max() <= 1e-4
    assert len(step_logits) == NUM_DECODE_STEPS
    for i, logits in enumerate(step_logits):  # step i samples token i from position prompt_len - 1 + i
        assert (logits - reference[prompt_len - 1 + i]).abs().max() <= 1e-4, f"decode step {i}"
    assert tokens == generated


@pytest.mark.parametrize("kind", sorted(DEEPSEEK_KINDS))
def test_logits_match_transformers(tmp_path, kind):
    path = make_deepseek(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256))
    prompt = random_prompt(37)
    prompt_logits, step_logits, tokens = engine_logits(engine, prompt)
    assert_matches(prompt_logits, step_logits, tokens, *hf_reference(path, prompt, tokens), len(prompt))


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_absorbed_equals_expanded(tmp_path, kind):
    """Either way everywhere (prefill included) gives transformers' logits, and the two agree closer still."""
    path = make_deepseek(tmp_path, kind)
    prompt = random_prompt(37)
    runs = {}
    for mode in ("absorbed", "expanded"):
        engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256))
        engine.model.attention_mode = mode
        runs[mode] = engine_logits(engine, prompt)
    reference, generated = hf_reference(path, prompt, runs["absorbed"][2])
    for prompt_logits, step_logits, tokens in runs.values():
        assert_matches(prompt_logits, step_logits, tokens, reference, generated, len(prompt))
    (absorbed_prompt, absorbed_steps, _), (expanded_prompt, expanded_steps, _) = runs.values()
    assert (absorbed_prompt - expanded_prompt).abs().max() <= 5e-5
    assert max((a - e).abs().max() for a, e in zip(absorbed_steps, expanded_steps)) <= 5e-5


def record_sampled_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """From now on, each sequence's logits at every step that samples it, by request id."""
    sampled = defaultdict(list)
    run = engine.runner.run

    def recording(out):
        step = run(out)
        for seq, row in zip(step.seqs, step.logits):
            sampled[seq.request_id].append(row)
        return step

    engine.runner.run = recording
    return sampled


@pytest.mark.parametrize("kind, mode", [("v2-lite", "auto"), ("v3", "auto"), ("v3", "expanded"), ("v3", "absorbed")])
def test_chunked_batched_preempted_match_transformers(tmp_path, kind, mode):
    """Three prompts batched, prefilled in chunks of at most 16 tokens, in a pool too small for all three (so
    sequences are preempted and recomputed): every prompt position and decode step still equals transformers'."""
    path = make_deepseek(tmp_path, kind)
    block_bytes = 16 * 3 * (32 + 8) * 4  # 16 tokens x 3 layers x (latent 32 + rope 8) x float32
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=9 * block_bytes, max_model_len=128,
                                    max_num_batched_tokens=16))
    engine.model.attention_mode = mode
    prompts = {"a": random_prompt(37, seed=1), "b": random_prompt(50, seed=2), "c": random_prompt(21, seed=3)}
    sampled = record_sampled_logits(engine)
    params = SamplingParams(max_tokens=NUM_DECODE_STEPS, temperature=0, ignore_eos=True, prompt_logprobs=-1)
    outputs = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert engine.stats()["num_preemptions"] > 0
    for request_id, prompt in prompts.items():
        out = outputs[request_id]
        reference, generated = hf_reference(path, prompt, out.outputs[0].token_ids)
        expected_logprobs = torch.log_softmax(reference[: len(prompt) - 1], dim=-1)
        assert (out.prompt_logprobs[1:] - expected_logprobs).abs().max() <= 1e-4
        steps = sampled[request_id]
        assert len(steps) == NUM_DECODE_STEPS
        for i, logits in enumerate(steps):
            assert (logits - reference[len(prompt) - 1 + i]).abs().max() <= 1e-4, f"{request_id} step {i}"
        assert out.outputs[0].token_ids == generated


def test_config_reads_a_real_v2_lite_config():
    """DeepSeek-V2-Lite's own config.json (rope_scaling with "type", no query LoRA): the cached vector is one
    latent 512 + rope 64 "head", routing is greedy softmax over 64 experts, the first layer dense."""
    import json

    from kvserve.planner.presets import __path__ as presets

    cfg = ModelConfig.from_hf(json.loads((Path(presets[0]) / "deepseek-v2-lite.json").read_text()))
    ds = cfg.deepseek
    assert (cfg.architecture, cfg.num_kv_heads, cfg.head_dim) == ("deepseek_v2", 1, 576)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_rope_head_dim, ds.v_head_dim) == (None, 512, 64, 128)
    assert (ds.scoring, ds.topk_method, ds.n_routed_experts, ds.num_experts_per_tok) == ("softmax", "greedy", 64, 6)
    assert not ds.is_moe_layer(0) and ds.is_moe_layer(1)


def test_a_quantized_checkpoint_is_refused_naming_what_to_do():
    """DeepSeek-V3's own repository holds fp8 weights with block scales, which loading as plain tensors would
    silently misread."""
    import json

    from kvserve.planner.presets import __path__ as presets

    config = json.loads((Path(presets[0]) / "deepseek-v3.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="quantized with 'fp8' are not supported; convert the weights to bfloat16"):
        ModelConfig.from_hf(config)
