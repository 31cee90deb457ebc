"""Our Gemma 3 decoder against transformers' on the same random weights (float32, max abs diff <= 1e-4): every
prompt position and 20 greedy decode steps alone, then three prompts batched through chunked prefill. Prompts stay
shorter than the sliding window (512), where sliding-window and full attention agree."""
import pytest
import torch
import transformers

from kvserve import LLM, EngineConfig, LLMEngine, SamplingParams
from kvserve.model.gemma3 import Gemma3Model
from tests.conftest import TINY_KINDS, make_tiny_model
from tests.model.test_llama_matches_transformers import NUM_DECODE_STEPS, engine_logits
from tests.model.test_qwen3_next import recording

GEMMA3_KINDS = sorted(kind for kind in TINY_KINDS if kind.startswith("gemma3"))
GREEDY = SamplingParams(max_tokens=NUM_DECODE_STEPS, temperature=0, ignore_eos=True)


def reference(path, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits over prompt + its greedy continuation, and that continuation."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE_STEPS, do_sample=False,
                                min_new_tokens=NUM_DECODE_STEPS)[0, len(prompt):].tolist()
        return hf(torch.tensor([prompt + generated])).logits[0], generated


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_logits_match_transformers(tmp_path, kind):
    path = make_tiny_model(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256))
    assert isinstance(engine.model, Gemma3Model)
    prompt = random_prompt(37, seed=1)
    prompt_logits, step_logits, tokens = engine_logits(engine, prompt)

    logits, generated = reference(path, prompt)
    assert (prompt_logits - logits[: len(prompt)]).abs().max() <= 1e-4
    assert len(step_logits) == NUM_DECODE_STEPS
    for i, step in enumerate(step_logits):  # step i samples token i from position len(prompt) - 1 + i
        assert (step - logits[len(prompt) - 1 + i]).abs().max() <= 1e-4, f"decode step {i}"
    assert tokens == generated


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_batched_chunked_logits_match_transformers(tmp_path, kind):
    path = make_tiny_model(tmp_path, kind)
    # 16 tokens a step: the 45-token prompt takes three chunks while the others prefill and decode beside it
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=16)
    prompts = [random_prompt(n, seed=n) for n in (45, 9, 23)]
    sampled = recording(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)

    for prompt, output in zip(prompts, outputs):
        logits, generated = reference(path, prompt)
        assert output.outputs[0].token_ids == generated
        steps = sampled[output.request_id]
        assert len(steps) == NUM_DECODE_STEPS
        for i, step in enumerate(steps):
            assert (step - logits[len(prompt) - 1 + i]).abs().max() <= 1e-4, f"prompt of {len(prompt)}, step {i}"


def test_layers_expose_their_attention_kind_and_window(tmp_path):
    path = make_tiny_model(tmp_path, "gemma3-gqa-scaled")  # sliding_window_pattern=3 over 3 layers
    model = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256)).model
    assert model.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert model.sliding_window == 512
    assert [layer.sliding_window for layer in model.layers] == [512, 512, None]


def test_bf16_follows_transformers_bf16(tmp_path):
    # bf16 rounds differently in every op, so only the greedy path is compared: same first tokens
    path = make_tiny_model(tmp_path, "gemma3-mqa")
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, dtype="bfloat16")
    prompt = random_prompt(20, seed=3)
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=5, temperature=0,
                                                                     ignore_eos=True))[0].outputs[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()
