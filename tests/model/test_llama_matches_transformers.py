"""Our forward pass against transformers' on the same random weights: logits at every prompt position and
at each of 20 greedy decode steps, float32, max abs diff <= 1e-4."""
import pytest
import torch
import transformers

from kvserve import LLMEngine, EngineConfig, SamplingParams
from tests.conftest import TINY_KINDS, make_tiny_model

NUM_DECODE_STEPS = 20


def engine_logits(engine: LLMEngine, prompt: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Logits at every prompt position, then the logits each decode step sampled from, and the greedy tokens."""
    hidden_per_step = []
    forward = engine.model.forward
    engine.model.forward = lambda *args: hidden_per_step.append(forward(*args)) or hidden_per_step[-1]
    engine.add_request("r", prompt, SamplingParams(max_tokens=NUM_DECODE_STEPS, temperature=0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
    logits = [engine.model.compute_logits(h) for h in hidden_per_step]
    return logits[0], [step[-1] for step in logits], tokens


@pytest.mark.parametrize("kind", sorted(k for k in TINY_KINDS if not k.startswith("gemma3")))  # see test_gemma3
def test_logits_match_transformers(tmp_path, kind):
    path = make_tiny_model(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256))
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_logits, step_logits, tokens = engine_logits(engine, prompt)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.tensor([prompt + tokens])
        reference = hf(full).logits[0]
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE_STEPS, do_sample=False,
                                min_new_tokens=NUM_DECODE_STEPS)[0, len(prompt):].tolist()

    assert (prompt_logits - reference[: len(prompt)]).abs().max() <= 1e-4
    assert len(step_logits) == NUM_DECODE_STEPS
    for i, logits in enumerate(step_logits):  # step i samples token i from position len(prompt) - 1 + i
        assert (logits - reference[len(prompt) - 1 + i]).abs().max() <= 1e-4, f"decode step {i}"
    assert tokens == generated
