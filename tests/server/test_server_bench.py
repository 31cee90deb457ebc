"""`kvserve bench serve` against a live server: every request completes with the asked-for output length and
the report carries vLLM's figures. Tiny random model with SmolLM2's tokenizer, as in test_server_api.py."""
import asyncio

import pytest

from kvserve import LLMEngine, EngineConfig
from kvserve.bench.serve import ServeBenchConfig, format_report, run_serve_bench, synthetic_requests
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = make_tiny_chat_model(tmp_path_factory.mktemp("bench") / "tiny-chat")
    engine = LLMEngine(EngineConfig(model=str(directory), kv_cache_memory="64MiB", max_model_len=1024))
    with ServerThread(build_app(engine)) as server:
        yield server


def test_bench_serve_reports_every_request(server):
    config = ServeBenchConfig(base_url=server.url, num_prompts=8, request_rate=50.0, input_len=32, output_len=8,
                              range_ratio=0.5, seed=3)
    report = asyncio.run(run_serve_bench(config))
    lengths = [r.max_tokens for r in synthetic_requests(config)]
    assert report.model == "tiny-chat"
    assert len(report.succeeded) == 8
    assert report.total_output_tokens == sum(lengths)
    assert 8 * 16 <= report.total_input_tokens <= 8 * 48 * 2  # about 32 words each, spread by half
    ttft, itl = report.distribution_ms("ttft"), report.distribution_ms("itl")
    assert 0 < ttft["P50"] <= ttft["P90"] <= ttft["P99"]
    assert itl["Mean"] > 0
    text = format_report(report)
    for label in ("Successful requests:", "Output token throughput (tok/s):", "P99 TTFT (ms):", "P90 ITL (ms):"):
        assert label in text


def test_same_seed_same_load():
    config = ServeBenchConfig(num_prompts=5, range_ratio=0.5, seed=1)
    assert synthetic_requests(config) == synthetic_requests(config)
    assert synthetic_requests(config) != synthetic_requests(ServeBenchConfig(num_prompts=5, range_ratio=0.5, seed=2))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="range_ratio"):
        ServeBenchConfig(range_ratio=1.5)
