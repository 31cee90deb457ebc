"""The benches on hybrid (Gated DeltaNet) models, on a tiny random Qwen3.5: the model builder gives the same bytes
for the same seed and its directory runs in kvserve and transformers alike; `kvserve bench multiturn
--hybrid-model` resumes every returning turn from a state checkpoint, prefilling what a plain model would; `kvserve
bench throughput --hybrid-model --phases` runs beside transformers on the same model."""
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvserve import LLM, SamplingParams
from kvserve.bench import hybrid_model
from kvserve.bench.conversation import Conversation
from kvserve.bench.multiturn import run_multiturn
from kvserve.cli import main

# the 0.8B's pattern and proportions, shrunk: 4 layers (3 Gated DeltaNet, 1 full attention), tied embeddings
TINY = {**hybrid_model.QWEN35_08B, **dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=8, max_position_embeddings=4096,
                                          initializer_range=0.1, eos_token_id=2)}
BLOCK = 16


@pytest.fixture
def tiny_registered(monkeypatch, tmp_path):
    """`--hybrid-model tiny` builds TINY into a cache under tmp_path."""
    monkeypatch.setitem(hybrid_model.HYBRID_MODELS, "tiny", TINY)
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_builder_is_seeded_and_its_model_runs_in_kvserve_and_transformers(tmp_path):
    a = hybrid_model.build_hybrid_model(tmp_path / "a", TINY, seed=0)
    b = hybrid_model.build_hybrid_model(tmp_path / "b", TINY, seed=0)
    c = hybrid_model.build_hybrid_model(tmp_path / "c", TINY, seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    weights, other = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert weights.keys() == other.keys() and "lm_head.weight" not in weights  # tied to the embeddings
    assert any(not torch.equal(weights[k], other[k]) for k in weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 40:].tolist()
    llm = LLM(str(a), kv_cache_memory="8MiB", max_model_len=256, max_num_seqs=2)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    assert "4 layers (3 Gated DeltaNet, 1 full attention)" in hybrid_model.describe_hybrid_model(a)


def test_the_cached_model_is_built_once_and_unknown_names_are_refused(tiny_registered):
    path = hybrid_model.hybrid_model_path("tiny")
    built = (path / "model.safetensors").stat().st_mtime_ns
    assert hybrid_model.hybrid_model_path("tiny") == path and path.parent.parent == tiny_registered
    assert (path / "model.safetensors").stat().st_mtime_ns == built
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no build directory left behind
    with pytest.raises(ValueError, match="unknown hybrid model 'nope'; choose one of"):
        hybrid_model.hybrid_model_path("nope")


def test_returning_turns_resume_from_a_checkpoint_and_prefill_what_a_plain_model_would(tmp_path):
    path = hybrid_model.build_hybrid_model(tmp_path, TINY)
    conversation = Conversation(first_tokens=100, question_tokens=30, answer_tokens=20, turns=5)
    runs = run_multiturn(conversation, str(path), kv_cache_memory="16MiB", max_model_len=1024, max_num_seqs=2)
    cached, baseline = runs["prefix caching"], runs["no prefix caching"]
    assert [t.prefilled_tokens for t in baseline] == [t.prompt_tokens for t in baseline]
    assert cached[0].prefilled_tokens == 100
    for before, turn in zip(cached, cached[1:]):
        # the KV blocks the previous turn filled (its last token is never computed), all of them resumed
        reused = (before.prompt_tokens + conversation.answer_tokens - 1) // BLOCK * BLOCK
        assert turn.cached_tokens == reused and turn.prefilled_tokens == turn.prompt_tokens - reused
    assert [t.token_ids[:1] for t in cached] == [t.token_ids for t in baseline]
    assert sum(t.prefilled_tokens for t in cached) * 3 < sum(t.prefilled_tokens for t in baseline)


def test_requests_sharing_a_first_prompt_resume_where_they_part_from_the_third_on(tmp_path):
    # a 100-token first prompt (6 full blocks) and 30 tokens each: the first computes it all; the second finds the
    # 6 blocks but no state after them and computes it all too, saving one there; the others resume there
    path = hybrid_model.build_hybrid_model(tmp_path, TINY)
    conversation = Conversation(first_tokens=100, question_tokens=30, answer_tokens=3, turns=4)
    runs = run_multiturn(conversation, str(path), kv_cache_memory="16MiB", max_model_len=1024, max_num_seqs=2,
                         shared_first=True)
    cached, baseline = runs["prefix caching"], runs["no prefix caching"]
    assert [t.prompt_tokens for t in cached] == [130] * 4 == [t.prefilled_tokens for t in baseline]
    assert [t.cached_tokens for t in cached] == [0, 0, 96, 96]
    assert [t.prefilled_tokens for t in cached] == [130, 130, 34, 34]
    assert [t.token_ids[:1] for t in cached] == [t.token_ids for t in baseline]


def test_multiturn_on_a_hybrid_model_prints_its_checkpoints(tiny_registered, capsys):
    argv = ["bench", "multiturn", "--hybrid-model", "tiny", "--first", "64", "--question", "16", "--answer", "17",
            "--turns", "3", "--kv-cache-memory", "16MiB", "--max-model-len", "512", "--max-num-seqs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "random weights (bfloat16 on disk), 4 layers (3 Gated DeltaNet, 1 full attention)" in out
    assert re.search(r"state checkpoints: \d held of 2 slots x [\d.]+ MiB .* 2 admissions resumed from one", out,
                     re.S)
    assert "returning turns (2-3): mean TTFT" in out


def test_throughput_on_a_hybrid_model_runs_beside_transformers(tiny_registered, capsys):
    argv = ["bench", "throughput", "--hybrid-model", "tiny", "--num-requests", "3", "--min-prompt-len", "20",
            "--max-prompt-len", "20", "--output-len", "6", "--dtypes", "float32", "--workloads", "decode",
            "--hf-batch-size", "3", "--phases", "--kv-cache-memory", "16MiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "llama.cpp: left out" in out and "roofline: left out" in out
    assert "transformers: Gated DeltaNet through its torch fallback" in out
    assert "kvserve (float32): greedy output identical to transformers for 100% of requests" in out
    assert re.search(r"│ transformers +│ +18 │", out)  # 3 requests x 6 tokens
    assert len(re.findall(r"kvserve \(float32\) ÷ transformers: decode [\d.]+x, prefill [\d.]+x", out)) == 2
    assert "prefill tokens/s" in out
