"""The engine on a CUDA device (`--device cuda`): the device is a parameter, so every check here is one that runs on
the CPU elsewhere in the suite, run again where the weights, the pool and each step's tensors live on the GPU. They
need a CUDA device and are skipped without one (this project's CI has none); docs/architecture.md, "Devices", says
when they last ran and what they found.

- float32 logits match transformers' on the same device, prompt and decode steps (test_llama_matches_transformers);
- every KV format gives the CPU's tokens, logprobs within the lossy formats' tolerance (its stored codes come from
  keys that the GPU rounded otherwise); int8 weights within the compiled step's int8 tolerance (a rotated activation
  that the GPU rounded otherwise can land on the next int8 code);
- the compiled decode step (Inductor's Triton kernels there) matches eager on the device;
- seeded sampling, n > 1, preemption and prefix hits run, and every block goes back to the pool."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.conftest import make_tiny_model
from tests.compile.test_steps import COMMON, INT8_LOGPROB_TOLERANCE, LOSSY_KV_TOLERANCE, PROMPTS, compare
from tests.model.test_llama_matches_transformers import NUM_DECODE_STEPS, engine_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = dict(device="cuda")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
# cuBLAS and cuDNN add float32 sums in their own orders (TF32 stays off: torch's default for matmuls)
DEVICE_TOLERANCE = 1e-4


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3-gqa", "gemma3-mqa"])
def test_logits_match_transformers_on_the_device(tmp_path, kind):
    path = make_tiny_model(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, **CUDA))
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_logits, step_logits, tokens = engine_logits(engine, prompt)
    assert prompt_logits.device.type == "cuda"

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0]
    assert float((prompt_logits - reference[: len(prompt)]).abs().max()) <= DEVICE_TOLERANCE
    assert len(step_logits) == NUM_DECODE_STEPS
    for i, logits in enumerate(step_logits):
        assert float((logits - reference[len(prompt) - 1 + i]).abs().max()) <= DEVICE_TOLERANCE, f"decode step {i}"


@pytest.mark.parametrize("options", [dict(kv_cache_dtype="bfloat16"), dict(kv_cache_dtype="fp8"),
                                     dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="int4"),
                                     dict(quantization="int8")], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_each_format_gives_the_cpus_tokens(tmp_path, options):
    path = make_tiny_model(tmp_path)
    cpu = LLM(str(path), **COMMON, **options, enforce_eager=True)
    gpu = LLM(str(path), **COMMON, **options, **CUDA, enforce_eager=True)
    deviations: list[float] = []
    tolerance = INT8_LOGPROB_TOLERANCE if "quantization" in options else LOSSY_KV_TOLERANCE
    compare(cpu, gpu, PROMPTS, GREEDY, some_compiled=False, tolerance=tolerance, deviations=deviations)
    print(f"{options}: largest |logprob difference| CPU vs CUDA {max(deviations):.2e}")
    assert gpu.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3-mqa"])
def test_the_compiled_step_matches_eager_on_the_device(tmp_path, kind):
    path = make_tiny_model(tmp_path, kind)
    eager = LLM(str(path), **COMMON, **CUDA, enforce_eager=True)
    compiled = LLM(str(path), **COMMON, **CUDA, compile_decode=True)
    assert compiled.engine.runner.compiled is not None, "the decode step did not compile"
    deviations: list[float] = []
    compare(eager, compiled, PROMPTS, GREEDY, deviations=deviations)
    compare(eager, compiled, PROMPTS[:1], GREEDY, deviations=deviations)  # the single stream's whole graph
    print(f"{kind}: largest |logprob difference| compiled vs eager on CUDA {max(deviations):.2e}")


def test_sampling_samples_preemption_and_prefix_hits_run_on_the_device(tmp_path):
    path = make_tiny_model(tmp_path)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, n=3, ignore_eos=True)
    prompts = [list(range(3, 60))] * 2 + PROMPTS  # the repeated prompt hits the prefix cache
    runs = []
    for _ in range(2):
        llm = LLM(str(path), kv_cache_memory=20 * 16 * 512, max_model_len=128, **CUDA)  # 20 blocks
        runs.append([[o.token_ids for o in r.outputs] for r in llm.generate(prompts, sampled)])
        stats = llm.stats()
        assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        assert stats["num_preemptions"] > 0
    assert runs[0] == runs[1]
    assert all(len(samples) == 3 and all(len(t) == 16 for t in samples) for samples in runs[0])
