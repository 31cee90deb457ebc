"""A server restarted on the same --kv-disk-cache directory: its first answer reuses the prefix from disk,
usage.prompt_tokens_details.cached_tokens counts those tokens, and /metrics shows the tier."""
import httpx

from kvserve import EngineConfig, LLMEngine
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model, scrape_metrics

BODY = {"prompt": "The disk keeps what the pool let go. " * 8, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def serve_once(model_dir, disk_dir) -> tuple[dict, dict[str, float]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="16MiB", max_model_len=256,
                                    kv_disk_cache=str(disk_dir), kv_disk_cache_size="64MiB"))
    with ServerThread(build_app(engine)) as server:
        answer = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()
        assert engine.disk_cache.store.flush(10)
        metrics = scrape_metrics(server.url, "tiny-chat")
    return answer, metrics


def test_a_restarted_server_answers_from_disk_and_says_so(tmp_path):
    model_dir = make_tiny_chat_model(tmp_path / "tiny-chat")
    first, first_metrics = serve_once(model_dir, tmp_path / "kv")
    second, metrics = serve_once(model_dir, tmp_path / "kv")
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16 > 0
    assert first["usage"]["kvserve_cached_tokens_by_tier"] == {"pool": 0, "disk": 0}
    assert second["usage"]["kvserve_cached_tokens_by_tier"] == {"pool": 0, "disk": cached}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # the writer may finish after the stats a scrape reads were published (after each step): only "some"
    assert first_metrics["kvserve:kv_disk_cache_writes_total"] > 0 and metrics["kvserve:kv_disk_cache_blocks"] > 0
    assert metrics["kvserve:kv_disk_cache_hit_tokens_total"] == cached
    assert metrics["kvserve:kv_disk_cache_reads_total"] == cached // 16
    assert metrics["kvserve:kv_disk_cache_capacity_bytes"] == 64 * 2**20
    assert metrics["kvserve:kv_disk_cache_state_checkpoints"] == 0  # a plain model keeps no states
    assert metrics['kvserve:kv_disk_cache_errors_total{kind="corrupt"}'] == 0
    assert metrics["kvserve:kv_disk_cache_read_seconds_total"] > 0
