"""The server with a quantized KV cache and with eviction: answers equal the offline engine with the same settings,
and /metrics names the format and counts evicted blocks."""
import httpx
import pytest

from kvserve import LLM, LLMEngine, EngineConfig, SamplingParams
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model

SETTINGS = {
    "int8": dict(kv_cache_dtype="int8"),
    "int4-streaming": dict(kv_cache_dtype="int4", kv_eviction="streaming", kv_sink_tokens=4, kv_recent_tokens=48),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("kv-settings") / "tiny-chat")


@pytest.mark.parametrize("name", list(SETTINGS))
def test_answers_equal_offline_and_metrics_name_the_kv_setting(model_dir, name):
    options = dict(kv_cache_memory="16MiB", max_model_len=256, **SETTINGS[name])
    prompt = "The cache keeps what every query reads. " * 3
    body = {"prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    expected = LLM(str(model_dir), **options).generate(
        prompt, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))[0].outputs[0].text
    engine = LLMEngine(EngineConfig(model=str(model_dir), **options))
    with ServerThread(build_app(engine)) as server:
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(server.url + "/metrics").text
    assert answer["choices"][0]["text"] == expected
    fmt = SETTINGS[name]["kv_cache_dtype"]
    info = next(line for line in metrics.splitlines() if line.startswith("kvserve:kv_cache_info{"))
    assert f'kv_cache_dtype="{fmt}"' in info and f'kv_eviction="{SETTINGS[name].get("kv_eviction", "none")}"' in info
    evicted = next(line for line in metrics.splitlines() if line.startswith("kvserve:kv_evicted_blocks_total{"))
    assert (float(evicted.rsplit(" ", 1)[1]) > 0) == ("streaming" in name)
