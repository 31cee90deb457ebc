"""Engine settings on hybrid models: --compile-decode runs their decode steps eagerly, saying why at start, with
decode attention read in place; --batch-invariant is refused with the reason it cannot hold."""
import logging

import pytest

from kvserve import LLM, EngineConfig, LLMEngine
from tests.model.test_qwen3_next import GREEDY, assert_nothing_held, make_hybrid_model, random_prompt, reference


def test_compile_decode_runs_decode_steps_eagerly_and_says_why(tmp_path, caplog):
    path = make_hybrid_model(tmp_path, "qwen3_5")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4, compile_decode=True)
    assert "decode steps: eager (Qwen3NextModel is not compiled" in caplog.text
    assert "compiled decode attention in place" in caplog.text
    prompts = [random_prompt(n, seed=n) for n in (20, 45)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [reference(path, p)[1] for p in prompts]
    assert llm.engine.runner.num_steps > 0 and llm.engine.runner.num_compiled_steps == 0
    assert_nothing_held(llm.engine)


def test_batch_invariance_is_refused_with_its_reason(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_next")
    with pytest.raises(ValueError, match="batch_invariant is not supported with hybrid models .*where its prompt is "
                                         "cut into chunks.*turn it off"):
        LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, batch_invariant=True))
