"""LLM.beam_search gives transformers' generate(num_beams=k, do_sample=False) hypotheses (default
early_stopping=False, any length_penalty, EOS inside max_tokens included); forked beams share their blocks
and dropped ones release them, so the beams hold the prompt once; nothing is left held at the end."""
import functools
from collections import Counter

import pytest
import torch
import transformers

from kvserve import LLM, BeamSearchParams, SamplingParams
from kvserve.kv.kv_cache_manager import blocks_needed
from tests.conftest import make_tiny_model

BS = 16
MAX_TOKENS = 24
PROMPT_LENS = (5, 17, 30)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory, prompts):
    """The tiny model with its most often generated token as EOS, so hypotheses do end in EOS."""
    plain = make_tiny_model(tmp_path_factory.mktemp("beam-plain"), "llama-gqa", seed=3)
    llm = LLM(str(plain), kv_cache_memory="1MiB", max_model_len=256)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    eos = Counter(t for o in outputs for t in o.outputs[0].token_ids).most_common(1)[0][0]
    return make_tiny_model(tmp_path_factory.mktemp("beam-eos"), "llama-gqa", seed=3, eos_token_id=eos)


@pytest.fixture(scope="module")
def no_eos_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("beam-no-eos"), "llama-gqa", seed=3, eos_token_id=None)


@functools.cache
def load_hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def hf_beams(model_dir, prompt: list[int], k: int, length_penalty: float) -> tuple[list[list[int]], list[float]]:
    """transformers' k hypotheses (generated tokens, up to and with EOS) and their scores, best first."""
    model = load_hf(model_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                             max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    eos = model.generation_config.eos_token_id
    sequences = []
    for row in out.sequences[:, len(prompt):].tolist():
        sequences.append(row[: row.index(eos) + 1] if eos in row else row)  # padding follows an EOS
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_hypotheses_match_transformers(eos_model_dir, prompts, k, length_penalty):
    llm = LLM(str(eos_model_dir), kv_cache_memory="1MiB", max_model_len=256)
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS,
                                                        length_penalty=length_penalty))
    for prompt, result in zip(prompts, results):
        hf_sequences, hf_scores = hf_beams(eos_model_dir, prompt, k, length_penalty)
        assert result.prompt_token_ids == prompt
        assert [h.token_ids for h in result.sequences] == hf_sequences
        assert [h.score for h in result.sequences] == pytest.approx(hf_scores, rel=1e-4)
    if length_penalty == 1.0 and k == 4:  # the EOS model does cut beams short
        assert {h.finish_reason for r in results for h in r.sequences} == {"stop", "length"}


def test_ignore_eos_matches_transformers_on_a_model_without_eos(eos_model_dir, no_eos_model_dir, prompts):
    llm = LLM(str(eos_model_dir), kv_cache_memory="1MiB", max_model_len=256)
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        hf_sequences, _ = hf_beams(no_eos_model_dir, prompt, 3, 1.0)
        assert result.sequences[0].token_ids == hf_sequences[0]
        assert all(len(h.token_ids) == MAX_TOKENS and h.finish_reason == "length" for h in result.sequences)


def test_beams_share_blocks_and_release_them(eos_model_dir, prompts, monkeypatch):
    k, prompt = 4, prompts[2]
    llm = LLM(str(eos_model_dir), kv_cache_memory="1MiB", max_model_len=256)
    engine, used, running = llm.engine, [], []
    step = engine.step

    def checked_step():
        outputs = step()
        holders = Counter(b for seq in engine.scheduler.running for b in engine.kv.block_ids(seq.request_id))
        assert {b.block_id: b.ref_cnt for b in engine.kv.pool.blocks if b.ref_cnt} == dict(holders)
        used.append(llm.stats()["num_used_blocks"])
        running.append(llm.stats()["num_running"])
        return outputs

    monkeypatch.setattr(engine, "step", checked_step)
    result = llm.beam_search(prompt, BeamSearchParams(beam_width=k, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert len(result.sequences) == k
    assert engine.stats()["num_prefill_tokens"] == len(prompt)  # the prompt is computed once for all beams
    assert max(running) == k
    shared = len(prompt) // BS  # every beam descends from the prompt's full blocks
    own = blocks_needed(len(prompt) + MAX_TOKENS, BS) - shared
    assert max(used) <= shared + k * own < k * (shared + own)
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0 and not engine.requests
    assert all(block.ref_cnt == 0 for block in engine.kv.pool.blocks)


def test_bad_arguments_raise_before_anything_runs(eos_model_dir, prompts):
    llm = LLM(str(eos_model_dir), kv_cache_memory="1MiB", max_model_len=64)
    with pytest.raises(ValueError, match="beam_width=11 needs the top 22 log-probs"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=11))
    with pytest.raises(ValueError, match="prompt 3: .*max_model_len=64"):
        llm.beam_search(prompts + [[5] * 60], BeamSearchParams(beam_width=2, max_tokens=8))
    assert not llm.engine.requests and llm.stats()["num_used_blocks"] == 0
    llm.engine.add_request("busy", prompts[0], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2))
    llm.engine.abort_request("busy")
