"""Every KV storage format with a hybrid model (Qwen3-Next and Qwen3.5 layouts): only the full-attention layers are
paged, in the format; the linear layers' state stays float32. Against the float32 KV cache: bitwise for float32,
and within a bound per format for the others, on every prompt position of a prompt prefilled in chunks (later
chunks read the earlier ones' K/V from the cache) and on decode steps (the format's decode attention); no block
or state slot left held."""
import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.model.test_qwen3_next import assert_nothing_held, make_hybrid_model, random_prompt, recording

# Mean KL(float32 KV || format) of the next-token distributions, about three times the larger of the two layouts'
# when written (prompt positions: bf16 4.1e-7, int8 2.5e-6, fp8 4.8e-5, int4 3.2e-4, fp16 6.1e-9, fp8_e5m2 2.2e-4,
# nuq4 3.2e-4, nuq3 1.1e-3, nuq3k4v 6.0e-4; decode steps: bf16 4.0e-7, int8 2.7e-6, fp8 6.3e-5, int4 2.8e-4,
# fp16 2.8e-8, fp8_e5m2 1.4e-4, nuq4 3.9e-4, nuq3 1.8e-3, nuq3k4v 9.1e-4). float16's is at float32's rounding, where
# an estimate of KL may come out below 0: each format is checked to differ from float32, and its KL to stay below
MAX_KLD = {"bfloat16": 2e-6, "int8": 1e-5, "fp8_e4m3": 2e-4, "int4": 1e-3, "float16": 1e-7, "fp8_e5m2": 7e-4,
           "nuq4": 1.2e-3, "nuq3": 6e-3, "nuq3k4v": 3e-3}
SCORE = SamplingParams(max_tokens=1, prompt_logprobs=-1)
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return make_hybrid_model(tmp_path_factory.mktemp(request.param), request.param)


def run(model_dir, fmt: str) -> tuple[torch.Tensor, list[list[int]], dict[str, list[torch.Tensor]], LLM]:
    """Prompt logprobs of a 120-token prompt in chunks of 32, then three greedy requests batched: their tokens and
    the logits each decode step sampled from."""
    llm = LLM(str(model_dir), kv_cache_dtype=fmt, kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=32)
    prompt_logprobs = llm.generate({"prompt_token_ids": random_prompt(120, seed=7)}, SCORE)[0].prompt_logprobs[1:]
    sampled = recording(llm)
    outputs = llm.generate([{"prompt_token_ids": random_prompt(n, seed=n)} for n in (17, 40, 70)], GREEDY)
    return prompt_logprobs, [o.outputs[0].token_ids for o in outputs], \
        [sampled[o.request_id] for o in outputs], llm


def kld(reference: torch.Tensor, tested: torch.Tensor) -> float:
    """Mean KL(reference || tested) over rows of log-probabilities."""
    return float((reference.exp() * (reference - tested)).sum(-1).mean())


def comparable_steps(reference_tokens, tokens, reference_steps, steps) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of the decode steps both runs took from the same tokens (up to and including the first
    step where their samples differ)."""
    rows, tested = [], []
    for ref_tokens, got_tokens, ref_steps, got_steps in zip(reference_tokens, tokens, reference_steps, steps):
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, got_tokens)) if a != b), len(ref_tokens) - 1)
        rows += ref_steps[: same + 1]
        tested += got_steps[: same + 1]
    return torch.stack(rows).log_softmax(-1), torch.stack(tested).log_softmax(-1)


@pytest.fixture(scope="module")
def reference(model_dir):
    return run(model_dir, "float32")[:3]


def test_float32_kv_is_bitwise_the_reference(model_dir, reference):
    prompt_logprobs, tokens, steps, llm = run(model_dir, "float32")
    assert llm.engine.cache.format_name == "float32"
    assert torch.equal(prompt_logprobs, reference[0]) and tokens == reference[1]
    assert all(torch.equal(a, b) for got, ref in zip(steps, reference[2]) for a, b in zip(got, ref))
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("fmt", list(MAX_KLD))
def test_each_format_stays_close_to_float32_kv(model_dir, reference, fmt):
    prompt_logprobs, tokens, steps, llm = run(model_dir, fmt)
    assert llm.engine.cache.format_name == fmt
    assert not torch.equal(prompt_logprobs, reference[0]) and kld(reference[0], prompt_logprobs) <= MAX_KLD[fmt]
    reference_rows, rows = comparable_steps(reference[1], tokens, reference[2], steps)
    assert not torch.equal(rows, reference_rows) and kld(reference_rows, rows) <= MAX_KLD[fmt]
    assert_nothing_held(llm.engine)
