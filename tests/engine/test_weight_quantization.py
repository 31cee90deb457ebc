"""quantization="int8" through the whole engine on tiny models of both decoder families: it runs end to end,
stays close to the float model, gives each prompt the same tokens alone or batched (also under preemption and
chunked prefill), leaks no block, says what it stores at start-up, and rejects unknown values by name."""
import logging

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.model.int8_kernels import FloatKernel
from tests.conftest import make_tiny_model, save_char_tokenizer

PROMPT_LENS = [3, 12, 17, 33, 57, 80, 120]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# Mean KL(float32 || int8 weights) over the next-token distributions of a 100-token prompt. The tiny random
# models measured 1.5e-3 (llama) and 4e-4 (gemma3) when written; random weights amplify rounding far more than
# a trained model does (kvserve eval measures the embedded model: docs/quality.md).
MAX_KLD = 5e-3


@pytest.fixture(scope="module", params=["llama-gqa", "gemma3-mqa"])
def model_dir(request, tmp_path_factory):
    return save_char_tokenizer(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make(model_dir, **options) -> LLM:
    return LLM(str(model_dir), quantization="int8", **{"kv_cache_memory": "1MiB", "max_model_len": 256, **options})


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_int8_outputs_do_not_depend_on_batching_chunking_or_preemption(model_dir, prompts):
    single = make(model_dir, enable_prefix_caching=False)
    alone = [tokens(single, [p])[0] for p in prompts]
    assert tokens(make(model_dir), prompts) == alone
    assert tokens(make(model_dir, max_num_batched_tokens=24), prompts) == alone
    # alone, a long prompt's first chunks sample nothing: the output head gets no rows (it raised on int8 weights);
    # its tokens are not compared with `alone`: other chunk boundaries round attention differently, which the default
    # mode allows to flip a near-tie (the batched line above meets the same risk)
    out = make(model_dir, max_num_batched_tokens=24).generate(prompts[-1:], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"
    block_bytes = single.engine.cache_plan.block_bytes * single.engine.layout.num_groups
    tight = make(model_dir, kv_cache_memory=10 * block_bytes, max_model_len=160)  # 160 tokens: the batch does not fit
    assert tokens(tight, prompts) == alone
    assert tight.stats()["num_preemptions"] > 0


def test_int8_next_token_distributions_stay_close_to_float(model_dir):
    prompt = torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(9)).tolist()
    score = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    reference = LLM(str(model_dir), max_model_len=256).generate(prompt, score)[0].prompt_logprobs[1:]
    tested = make(model_dir).generate(prompt, score)[0].prompt_logprobs[1:]
    kld = float((reference.exp() * (reference - tested)).sum(-1).mean())
    assert 0 < kld < MAX_KLD


def test_start_up_names_the_weights_format_and_their_memory(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        float_llm = LLM(str(model_dir), max_model_len=256)
        int8_llm = make(model_dir)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights: ")]
    # a tied table that oneDNN's float linear multiplies is held twice, and the line says so (float_kernels.py)
    copy = float_llm.engine.model.linears.tied_copy_nbytes
    assert lines[0].endswith("MB float32") if not copy else \
        "MB float32 (of which 0.1 MB is oneDNN linear's packed copy of the tied embedding table" in lines[0]
    assert " MB int8 (per-output-channel scales" in lines[1]
    # int8 codes are a quarter of float32; the scales, norms and any kernel-packed copy add the rest. Where no
    # int8 kernel beats float32 (an AVX2-only CPU; a tiny model's shapes, which the probe times), the fallback
    # multiplies float32 copies of the codes: as many bytes as float32, beside which a tied table keeps its codes
    # for the lookups (the head's float copy of them counted as tied_copy_nbytes)
    int8_bytes, float_bytes = int8_llm.engine.model.weights_nbytes, float_llm.engine.model.weights_nbytes
    ratio = int8_bytes / float_bytes
    if isinstance(int8_llm.engine.model.linears.kernel, FloatKernel):
        assert 0.9 < (int8_bytes - int8_llm.engine.model.linears.tied_copy_nbytes) / float_bytes < 1.1
    else:
        assert 0.25 < ratio < 0.6


def test_unknown_quantization_is_rejected_with_the_choices(model_dir):
    with pytest.raises(ValueError, match="quantization='int4' is not supported; choose one of none, int8"):
        LLM(str(model_dir), quantization="int4")


def test_cli_flag_runs_int8_and_rejects_unknown_values(model_dir, capsys):
    assert main(["generate", "hi", "--model", str(model_dir), "--quantization", "int8", "--max-tokens", "3",
                 "--max-model-len", "64", "--kv-cache-memory", "1MiB"]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--model", str(model_dir), "--quantization", "fp4"])
    err = capsys.readouterr().err
    assert "--quantization: invalid choice: 'fp4'" in err and "'none', 'int8'" in err


@pytest.mark.slow
@pytest.mark.parametrize("quantization, planner_dtype", [("none", "fp32"), ("int8", "int8")])
def test_engine_weights_agree_with_kvserve_plan(quantization, planner_dtype):
    """The embedded SmolLM2: what the engine holds is what `kvserve plan --weights-dtype` predicts, within the
    int8 scales (4 bytes per output channel) and the float32 norms the planner counts at the weights' size, plus
    the second copy of the tied embedding table that a kernel with its own packed weights keeps (and says so)."""
    import json

    from kvserve.planner.model_spec import ModelSpec
    from kvserve.planner.weights import weights_bytes

    llm = LLM(quantization=quantization, max_model_len=256, kv_cache_memory="16MiB")
    spec = ModelSpec.from_hf_config(json.loads((llm.engine.model_path / "config.json").read_text()))
    planned = weights_bytes(spec, planner_dtype) + llm.engine.model.linears.tied_copy_nbytes
    if isinstance(llm.engine.model.linears.kernel, FloatKernel):  # no int8 kernel pays on this CPU: float32
        # copies of the codes, and the tied table's int8 codes for lookups beside the head's float32 copy
        planned = weights_bytes(spec, "fp32") + spec.vocab_size * spec.hidden_size
    assert llm.engine.model.weights_nbytes == pytest.approx(planned, rel=0.01 if quantization == "int8" else 1e-6)
