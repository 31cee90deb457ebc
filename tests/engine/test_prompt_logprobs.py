"""SamplingParams(prompt_logprobs=k): every prompt token after the first gets its log-probability given the ones
before it (transformers' log-softmax within 1e-4), with the top k alternatives, also when the prompt is prefilled
in chunks, preempted and recomputed, or cached (a request that asks for them computes its whole prompt); -1 hands
back the whole vocabulary as one tensor, which take_prompt_logprobs can drain while a long prompt runs."""
import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

PROMPT_LEN = 70


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prompt-logprobs"), "llama-gqa")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def reference(model_dir, prompt):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].log_softmax(-1)  # row p predicts token p + 1


def make(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"kv_cache_memory": "1MiB", "max_model_len": 256, **options})


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["one-chunk", "chunked"])
def test_top_k_and_the_actual_token_match_transformers(model_dir, prompt, reference, options):
    out = make(model_dir, **options).generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    assert len(out.prompt_logprobs) == PROMPT_LEN and out.prompt_logprobs[0] is None
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        expected_top = reference[p].topk(3).indices.tolist()
        assert set(expected_top) | {prompt[p + 1]} == set(entry)
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(float(reference[p, token_id]), abs=1e-4)


def test_whole_vocabulary_rows_survive_preemption_and_prefix_hits(model_dir, prompt, reference):
    whole = SamplingParams(max_tokens=20, prompt_logprobs=-1, ignore_eos=True)
    llm = make(model_dir)
    llm.generate(prompt, SamplingParams(max_tokens=1))  # caches the prompt's full blocks
    first = llm.generate(prompt, whole)[0]
    assert first.num_cached_tokens == 0  # computed whole: cached blocks keep no logits
    assert torch.isnan(first.prompt_logprobs[0]).all()
    assert (first.prompt_logprobs[1:] - reference[:-1]).abs().max() <= 1e-4

    block_bytes = llm.engine.cache_plan.block_bytes
    tight = make(model_dir, kv_cache_memory=11 * block_bytes, max_model_len=128)  # both start, not both finish
    outputs = tight.generate([prompt, prompt[::-1]], whole)
    assert tight.stats()["num_preemptions"] > 0
    assert (outputs[0].prompt_logprobs[1:] - reference[:-1]).abs().max() <= 1e-4
    assert outputs[0].prompt_logprobs.shape == (PROMPT_LEN, 256)


def test_take_prompt_logprobs_hands_over_rows_as_they_are_computed(model_dir, prompt, reference):
    engine = make(model_dir, max_num_batched_tokens=16).engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, prompt_logprobs=-1, ignore_eos=True))
    taken = []
    while engine.has_unfinished_requests():
        engine.step()
        if "r" in engine.requests:
            taken.append(engine.take_prompt_logprobs("r"))
    rows = torch.cat(taken)
    assert len(rows) == PROMPT_LEN - 1 and (rows - reference[:-1]).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="did not ask for prompt_logprobs=-1"):
        engine.add_request("s", prompt, SamplingParams(max_tokens=1))
        engine.take_prompt_logprobs("s")
    engine.abort_request("s")


@pytest.mark.parametrize("value", [21, -2, 1.5, True])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in \\[0, 20\\], or -1"):
        SamplingParams(prompt_logprobs=value)
