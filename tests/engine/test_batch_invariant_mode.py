"""--batch-invariant: a request's logits are bitwise the same alone or batched — every prompt position and every
decode step, for every KV format, float and int8 weights, batch sizes 1..64, with chunked prefill, preemption,
prefix hits, n > 1 and sliding-window layers. The reference is each prompt alone in one step; the mode makes each
kernel call's shape a function of the model and the position only (kvserve/batch_invariant.py), so equality here
is what the code guarantees on any CPU, not a property of this one's BLAS."""
import logging

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

FORMATS = ["auto", "bfloat16", "fp8", "int8", "int4", "nuq4", "nuq3"]
PROMPT_LENS = [1, 5, 16, 17, 30, 33, 48, 70]
SCORED = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=-1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("invariant"), "llama-gqa")


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    """A tiny hybrid Gemma 3 whose sliding layers (window 24: not a block multiple) the prompts outgrow."""
    return make_tiny_model(tmp_path_factory.mktemp("invariant-sliding"), "gemma3-mqa", num_hidden_layers=3,
                           sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def prompts_of(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def make(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"kv_cache_memory": "2MiB", "max_model_len": 256, "batch_invariant": True,
                                  **options})


def logits_of(llm: LLM, prompts: list[list[int]], params: SamplingParams = SCORED) -> list[torch.Tensor]:
    """Per prompt (and per sample), every logits row the engine produced for it: each scored prompt position,
    then each sampled step, in order."""
    rows: dict[str, list[torch.Tensor]] = {}
    run = llm.engine.runner.run

    def recording(out):
        step = run(out)
        for seq, logits in step.prompt_logits:
            rows.setdefault(seq.request_id, []).extend(logits)
        for seq, logits in zip(step.seqs, step.logits):
            rows.setdefault(seq.request_id, []).append(logits)
        return step

    llm.engine.runner.run = recording
    llm.generate(prompts, params)
    return [torch.stack(rows[key]) for key in sorted(rows, key=_request_order)]


def _request_order(request_id: str) -> tuple[int, int]:
    """Sequence ids are the request's, plus "#i" for its i-th sample."""
    request, _, sample = request_id.partition("#")
    return int(request), int(sample or 0)


def alone(model_dir, prompts, params=SCORED, **options) -> list[torch.Tensor]:
    llm = make(model_dir, enable_prefix_caching=False, **options)
    return [logits_of(llm, [p], params)[0] for p in prompts]


def assert_bitwise(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape, f"prompt {i}: {a.shape[0]} logits rows, alone {b.shape[0]}"
        assert torch.equal(a, b), f"prompt {i}: max |difference| {float((a - b).abs().max()):.3g}"


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_batched_chunked_and_preempted_equal_alone(model_dir, kv_cache_dtype, quantization):
    prompts = prompts_of(PROMPT_LENS)
    options = dict(kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    expected = alone(model_dir, prompts, **options)
    assert_bitwise(logits_of(make(model_dir, **options), prompts), expected)
    # 24 tokens a step: prompts prefilled in chunks that end mid-block; 14 blocks: a few sequences at a time
    tight = make(model_dir, max_num_batched_tokens=24, max_model_len=128,
                 kv_cache_memory=14 * _block_bytes(model_dir, **options),
                 **options)
    assert_bitwise(logits_of(tight, prompts), expected)
    assert tight.stats()["num_preemptions"] > 0


def _block_bytes(model_dir, **options) -> int:
    engine = make(model_dir, **options).engine
    return engine.cache.nbytes // engine.cache.num_blocks


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_every_batch_size_from_1_to_64(model_dir, quantization):
    prompts = prompts_of([(7 * i) % 45 + 1 for i in range(64)], seed=5)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    expected = alone(model_dir, prompts, params, quantization=quantization)
    llm = make(model_dir, quantization=quantization, kv_cache_memory="8MiB", enable_prefix_caching=False)
    for size in range(1, 65):
        first = (size * 13) % (65 - size)  # a different slice each time: each prompt at many batch positions
        assert_bitwise(logits_of(llm, prompts[first : first + size], params), expected[first : first + size])


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_a_prefix_hit_equals_the_full_prefill(model_dir, kv_cache_dtype):
    shared = prompts_of([40])[0]
    tails = prompts_of([3, 9, 20], seed=8)
    prompts = [shared + tail for tail in tails]
    expected = alone(model_dir, prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                     kv_cache_dtype=kv_cache_dtype)
    llm = make(model_dir, kv_cache_dtype=kv_cache_dtype)
    llm.generate(shared, SamplingParams(max_tokens=1))
    got = logits_of(llm, prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert llm.stats()["prefix_cache_hits"] >= 2 * 32  # two full blocks of the shared prefix, for each prompt
    assert_bitwise(got, expected)


def test_n_samples_share_blocks_and_equal_alone(model_dir):
    prompts = prompts_of([20, 37])
    params = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=11)
    expected = [logits_of(make(model_dir, enable_prefix_caching=False), [p], params) for p in prompts]
    got = logits_of(make(model_dir), prompts, params)
    assert_bitwise(got, [rows for per_prompt in expected for rows in per_prompt])


def test_sliding_window_layers_keep_each_tile_s_keys(sliding_dir):
    prompts = prompts_of([10, 30, 50, 75])
    expected = alone(sliding_dir, prompts)
    assert_bitwise(logits_of(make(sliding_dir, max_num_batched_tokens=20), prompts), expected)
    decode = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # prompt logprobs would skip the hit
    llm = make(sliding_dir)
    llm.generate(prompts[3][:64], SamplingParams(max_tokens=1))  # a prefix hit brings only the window's blocks
    assert_bitwise(logits_of(llm, prompts[3:], decode), alone(sliding_dir, prompts[3:], decode))
    assert llm.stats()["prefix_cache_hits"] == 64


def test_the_mode_stays_close_to_transformers(model_dir):
    prompt = prompts_of([60])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0, :-1]
    got = logits_of(make(model_dir), [prompt], SamplingParams(max_tokens=1, prompt_logprobs=-1))[0][:-1]
    assert torch.allclose(got, reference, atol=1e-4)


def test_start_up_says_which_guarantee_holds(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        make(model_dir)
        make(model_dir, batch_invariant=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch invariance: ")]
    assert lines[0].startswith("batch invariance: bitwise (--batch-invariant")
    assert lines[1].startswith("batch invariance: same greedy tokens batched or alone up to float rounding")


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_eviction_is_refused_in_the_mode(model_dir, policy):
    with pytest.raises(ValueError, match=f"batch_invariant=True does not cover kv_eviction='{policy}'"):
        make(model_dir, kv_eviction=policy)


def test_the_flag_must_be_a_bool(model_dir):
    with pytest.raises(ValueError, match="batch_invariant must be True or False, got 'yes'"):
        make(model_dir, batch_invariant="yes")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_the_mode_is_refused_off_the_cpu(model_dir, device):
    # refused before any weight moves: no such device is needed to see it
    with pytest.raises(ValueError, match=f"guaranteed on a CPU only; device='{device}'"):
        make(model_dir, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "kv_cache_dtype": "fp8"}], ids=["float32", "int8-fp8"])
def test_the_embedded_model_is_bitwise_the_same_alone_or_batched(options):
    llm = LLM(batch_invariant=True, max_model_len=512, kv_cache_memory="64MiB", **options)
    texts = ["The capital of France is", "A KV cache stores", "Once upon a time, in a village by the sea, there",
             "def fibonacci(n):\n    "]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [logits_of(llm, [p], params)[0] for p in prompts]
    assert_bitwise(logits_of(llm, prompts, params), expected)
