"""kvserve's runner in `kvserve bench throughput`: what it records of each step, on a tiny model."""
from kvserve.bench.throughput import runners
from tests.conftest import make_tiny_model


def test_decode_steps_count_each_sequences_context_once_as_the_kv_they_read(tmp_path):
    from kvserve import LLM

    llm = LLM(model=str(make_tiny_model(tmp_path)), kv_cache_memory="16MiB")
    result = runners.run_kvserve(llm, [[5] * 5, [7] * 9], 4)  # both prefill in the first step, then decode

    # the steps sampling tokens 2..4 attend over prompt + (tokens so far - 1) keys: 5+1, 5+2, 5+3 and 9+1, 9+2, 9+3
    assert result.decode_tokens == 6 and result.decode_steps == 3
    assert result.decode_kv_bytes == (21 + 33) * llm.engine.cache_plan.kv_bytes_per_token > 0
