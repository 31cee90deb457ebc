"""An MLA model in the engine: the latent cache's size is the planner's, and it composes with prefix caching,
n > 1 copy-on-write, chunked prefill, preemption, int8/fp8 latent storage, int8 weights and --batch-invariant;
StreamingLLM equals a plain reference decoder past max_model_len; what it cannot run is refused by name."""
from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

from kvserve import LLM, BeamSearchParams, SamplingParams
from kvserve.config import parse_size
from kvserve.planner.kv_size import kv_bytes_per_token, resolve_kv_dtype
from kvserve.planner.model_spec import ModelSpec
from tests.engine.test_batch_invariant_mode import alone, assert_bitwise, logits_of, make, prompts_of
from tests.engine.test_beam_search import MAX_TOKENS, hf_beams
from tests.engine.test_kv_eviction import engine_step_logits
from tests.model.test_deepseek import hf_reference, make_deepseek

LATENT_FORMATS = ["auto", "bfloat16", "int8", "fp8", "fp8_e5m2"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory):
    return make_deepseek(tmp_path_factory.mktemp("deepseek-v2"), "v2-lite")


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return make_deepseek(tmp_path_factory.mktemp("deepseek-v3"), "v3")


def tokens_of(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("kv_cache_dtype", LATENT_FORMATS)
def test_allocation_is_the_planner_s_mla_figure(v2_dir, kv_cache_dtype, caplog):
    """3 layers x (latent 32 + rope 8) per token: 480 B in float32, 240 in bfloat16, 40 + 2 (its scale) x 3 = 126
    in int8 and fp8 — no per-head K and V (those would be 2 x 4 heads x 24 x 3 layers x 4 B = 2,304 B)."""
    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = LLM(str(v2_dir), kv_cache_memory="1MiB", max_model_len=256, kv_cache_dtype=kv_cache_dtype).engine
    import json

    spec = ModelSpec.from_hf_config(json.loads((v2_dir / "config.json").read_text()))
    plan = engine.cache_plan
    expected_per_token = {"auto": 480, "bfloat16": 240, "int8": 126, "fp8": 126, "fp8_e5m2": 126}[kv_cache_dtype]
    assert plan.kv_bytes_per_token == expected_per_token
    assert plan.kv_bytes_per_token == kv_bytes_per_token(spec, resolve_kv_dtype(engine.config.kv_cache_format, spec))
    assert engine.cache.nbytes == plan.kv_bytes_per_token * plan.kv_cache_tokens <= parse_size("1MiB")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache ("))
    assert "latent 32 + rope 8 per token and layer" in line and f"{plan.num_blocks:,} blocks" in line


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype='int4' is not supported for MLA models; use auto, float32, "
                                  "bfloat16, float16, int8, fp8_e4m3, fp8_e5m2"),
    (dict(kv_eviction="h2o"), "kv_eviction='h2o' is not supported for MLA models; use none or streaming"),
])
def test_what_mla_cannot_run_is_refused_by_name(v2_dir, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LLM(str(v2_dir), kv_cache_memory="1MiB", max_model_len=256, **options)


def test_a_prefix_hit_keeps_transformers_logits(v3_dir):
    """A second request sharing 40 prompt tokens reads two cached latent blocks and still decodes as transformers."""
    shared, tail = prompts_of([40])[0], prompts_of([9], seed=8)[0]
    llm = LLM(str(v3_dir), kv_cache_memory="1MiB", max_model_len=256)
    llm.generate(shared, SamplingParams(max_tokens=1))
    steps = logits_of(llm, [shared + tail], GREEDY)[0]
    assert llm.stats()["prefix_cache_hits"] == 32
    tokens = [int(row.argmax()) for row in steps]
    reference, generated = hf_reference(v3_dir, shared + tail, tokens[:-1])
    assert (steps - reference[len(shared + tail) - 1 :]).abs().max() <= 1e-4
    assert tokens == generated[: len(tokens)]


@pytest.mark.parametrize("kv_cache_dtype", LATENT_FORMATS)
def test_every_format_keeps_greedy_tokens_batched_chunked_preempted_and_after_hits(v2_dir, kv_cache_dtype):
    prompts = prompts_of([5, 17, 33, 48, 70])
    options = dict(kv_cache_dtype=kv_cache_dtype, max_model_len=128)
    expected = [tokens_of(LLM(str(v2_dir), kv_cache_memory="1MiB", enable_prefix_caching=False, **options), [p])[0]
                for p in prompts]
    block_bytes = 16 * LLM(str(v2_dir), kv_cache_memory="1MiB", **options).engine.cache_plan.kv_bytes_per_token
    tight = LLM(str(v2_dir), kv_cache_memory=14 * block_bytes, max_num_batched_tokens=24, **options)
    assert tokens_of(tight, prompts) == expected
    assert tight.stats()["num_preemptions"] > 0
    assert tokens_of(tight, prompts) == expected  # again, now from the prefix cache
    assert tight.stats()["prefix_cache_hits"] > 0


def test_quantized_latents_stay_close_to_float(v2_dir):
    """Mean KL divergence from float32 over 60 prompt positions (this random model's logits are sharp, so bounds
    on logits alone say little): one int8 scale per latent vector costs less than fp8's 3 mantissa bits."""
    prompt = prompts_of([60])[0]
    scored = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    reference = logits_of(LLM(str(v2_dir), kv_cache_memory="1MiB"), [prompt], scored)[0].log_softmax(-1)
    for kv_cache_dtype, bound in (("bfloat16", 1e-3), ("int8", 5e-3), ("fp8", 5e-2)):
        got = logits_of(LLM(str(v2_dir), kv_cache_memory="1MiB", kv_cache_dtype=kv_cache_dtype), [prompt], scored)[0]
        kl = (reference.exp() * (reference - got.log_softmax(-1))).sum(-1).mean()
        assert 0 < kl <= bound, f"{kv_cache_dtype}: mean KL {kl:.3g}"


def test_n_samples_share_the_prompt_s_latent_blocks(v3_dir):
    """n=2 forks the prompt's blocks (copy-on-write of the filling one); greedy samples both equal the single run."""
    prompt = prompts_of([37])[0]
    llm = LLM(str(v3_dir), kv_cache_memory="1MiB", max_model_len=256, enable_prefix_caching=False)
    single = tokens_of(llm, [prompt])[0]
    outs = llm.generate([prompt], SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True))[0].outputs
    assert [o.token_ids for o in outs] == [single, single]
    sampled = llm.generate([prompt], SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7))[0].outputs
    alone_sampled = [llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i))[0]
                     .outputs[0].token_ids for i in range(2)]
    assert [o.token_ids for o in sampled] == alone_sampled


def test_beam_search_matches_transformers(v3_dir):
    """Beams fork each other's latent blocks (copy-on-write) and give transformers' hypotheses and scores."""
    prompts = prompts_of([5, 30])
    llm = LLM(str(v3_dir), kv_cache_memory="1MiB", max_model_len=256)
    for prompt, result in zip(prompts, llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))):
        hf_sequences, hf_scores = hf_beams(v3_dir, prompt, 3, 1.0)
        assert [h.token_ids for h in result.sequences] == hf_sequences
        assert [h.score for h in result.sequences] == pytest.approx(hf_scores, rel=1e-4)


def test_int8_weights_run_the_experts_and_keep_tokens_batched(v3_dir):
    prompts = prompts_of([9, 30, 41])
    llm = LLM(str(v3_dir), kv_cache_memory="1MiB", quantization="int8")
    assert tokens_of(llm, prompts) == [tokens_of(llm, [p])[0] for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype, quantization", [("auto", "none"), ("int8", "none"), ("auto", "int8")])
def test_batch_invariant_mla_is_bitwise_batched_chunked_and_preempted(v3_dir, kv_cache_dtype, quantization):
    """--batch-invariant: every position absorbed over its own tile's keys, experts run densely on fixed tiles."""
    options = dict(kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    prompts = prompts_of([1, 16, 17, 33, 70])
    expected = alone(v3_dir, prompts, **options)
    assert_bitwise(logits_of(make(v3_dir, **options), prompts), expected)
    block_bytes = make(v3_dir, **options).engine.cache_plan.kv_bytes_per_token * 16
    tight = make(v3_dir, max_num_batched_tokens=24, max_model_len=128, kv_cache_memory=10 * block_bytes, **options)
    assert_bitwise(logits_of(tight, prompts), expected)
    assert tight.stats()["num_preemptions"] > 0


def test_batch_invariant_mla_prefix_hits_n_samples_and_transformers(v3_dir):
    shared, tails = prompts_of([40])[0], prompts_of([3, 20], seed=8)
    decode = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = make(v3_dir)
    llm.generate(shared, SamplingParams(max_tokens=1))
    assert_bitwise(logits_of(llm, [shared + t for t in tails], decode),
                   alone(v3_dir, [shared + t for t in tails], decode))
    assert llm.stats()["prefix_cache_hits"] >= 2 * 32
    samples = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=11)
    assert_bitwise(logits_of(make(v3_dir), [tails[1]], samples),
                   logits_of(make(v3_dir, enable_prefix_caching=False), [tails[1]], samples))
    prompt = prompts_of([60])[0]
    reference, _ = hf_reference(v3_dir, prompt, [])
    got = logits_of(make(v3_dir), [prompt], SamplingParams(max_tokens=1, prompt_logprobs=-1))[0][:-1]
    assert torch.allclose(got, reference[:-1], atol=1e-4)


@torch.no_grad()
def reference_streaming_logits(hf, token_ids: list[int], sinks: int, recent: int) -> torch.Tensor:
    """StreamingLLM over transformers' DeepSeek-V3 modules, written plainly: tokens one at a time; each layer keeps
    every token's normalized latent and its RoPE key before rotation; the query at position p attends to the first
    `sinks` tokens and the last `recent` (itself included), keys rotated by their place in that cache and the
    query by its own place, the last."""
    cfg = hf.config
    heads, nope, rope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    latents, rope_keys = [[] for _ in hf.model.layers], [[] for _ in hf.model.layers]
    logits = []
    for p, token in enumerate(token_ids):
        h = hf.model.embed_tokens(torch.tensor([[token]]))
        kept = sorted(set(range(min(sinks, p + 1))) | set(range(max(0, p - recent + 1), p + 1)))
        n = len(kept)
        cos, sin = hf.model.rotary_emb(h, torch.arange(n)[None])  # [1, n, rope], YaRN's factor included
        for i, layer in enumerate(hf.model.layers):
            attn, x = layer.self_attn, layer.input_layernorm(h)
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, heads, 1, nope + rope)
            compressed = attn.kv_a_proj_with_mqa(x)[0, 0]
            latents[i].append(attn.kv_a_layernorm(compressed[:rank]))
            rope_keys[i].append(compressed[rank:])
            k_rope = torch.stack([rope_keys[i][t] for t in kept])[None, None]  # [1, 1, n, rope]
            q_rope = apply_rotary_pos_emb_interleave(q[..., nope:], q[..., nope:], cos[:, -1:], sin[:, -1:])[0]
            k_rope = apply_rotary_pos_emb_interleave(k_rope, k_rope, cos, sin)[1][0, 0]  # [n, rope]
            kv = attn.kv_b_proj(torch.stack([latents[i][t] for t in kept])).view(n, heads, -1)
            k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)
            keys = torch.cat([k_nope, k_rope[:, None].expand(n, heads, rope)], dim=-1)
            query = torch.cat([q[0, :, 0, :nope], q_rope[0, :, 0]], dim=-1)  # [heads, nope + rope]
            weights = torch.einsum("hd,khd->hk", query, keys) * attn.scaling
            out = torch.einsum("hk,khd->hd", weights.softmax(-1), v)
            h = h + attn.o_proj(out.reshape(1, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(hf.lm_head(hf.model.norm(h))[0, 0])
    return torch.stack(logits)


@pytest.mark.parametrize("prompt_len, chunk", [(1, 2048), (100, 24)])
def test_streaming_equals_a_plain_reference_decoder_past_max_model_len(v3_dir, prompt_len, chunk):
    """Sinks 4 + window 40 on YaRN RoPE: keys are rotated once, at their positions; sink keys are scored with the
    query's rope part rotated back (a pure rotation, YaRN's magnitude factor not applied twice)."""
    sinks, recent, max_len = 4, 40, 64
    prompt = prompts_of([prompt_len], seed=2)[0]
    llm = LLM(str(v3_dir), kv_cache_memory="1MiB", max_model_len=max_len, max_num_batched_tokens=chunk,
              kv_eviction="streaming", kv_sink_tokens=sinks, kv_recent_tokens=recent)
    tokens, step_logits = engine_step_logits(llm, prompt, 3 * max_len)
    assert len(prompt + tokens) > 3 * max_len and llm.stats()["num_evicted_blocks"] > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(v3_dir, dtype=torch.float32).eval()
    reference = reference_streaming_logits(hf, prompt + tokens, sinks, recent)
    for i, logits in enumerate(step_logits):  # step i samples output token i from position prompt_len - 1 + i
        assert (logits - reference[prompt_len - 1 + i]).abs().max() <= 1e-4, f"decode step {i}"
    scored = llm.generate(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=-1))[0].prompt_logprobs
    assert (scored[1:] - reference[:-1].log_softmax(-1)).abs().max() <= 1e-4  # every position, prefilled
