"""The dashboard's routes: /v1/kv/blocks shows which blocks each running request holds, agrees with the engine's
stats, needs the API key like every /v1 route, and /v1/kv/history keeps per-second rates. The page itself
(/dashboard) is checked in a real browser in test_dashboard_browser.py; here only that it is served whole."""
import asyncio
import re
import threading
import time

import httpx
import pytest

from kvserve import EngineConfig, LLMEngine
from kvserve.server.app import build_app
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.dashboard import StatsHistory
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model
from tests.server.step_gate import StepGate

ENGINE_OPTIONS = dict(kv_cache_memory="1MiB", max_model_len=512)  # 128 blocks of 16 tokens
SYSTEM = list(range(1000, 1040))  # 40 tokens: two full blocks both requests start with


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("dashboard") / "tiny-chat")


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))


@pytest.fixture(scope="module")
def server(engine):
    # These tests look at the pool at exact moments: no view is shared between polls (test_kv_blocks_* below).
    with ServerThread(build_app(engine, kv_blocks_max_age_s=0)) as server:
        yield server


def complete(url: str, prompt: list[int], max_tokens: int = 4, **headers) -> None:
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text


def blocks(url: str, **headers) -> dict:
    response = httpx.get(url + "/v1/kv/blocks", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def holders_by_block(view: dict) -> dict[int, list[str]]:
    holders: dict[int, list[str]] = {}
    for seq in view["sequences"]:
        for block_id in seq["block_ids"]:
            holders.setdefault(block_id, []).append(seq["request_id"])
    return holders


def test_running_requests_show_their_blocks_and_a_shared_prefix(server, engine):
    gate = StepGate(engine)
    gate.hold()
    first = threading.Thread(target=complete, args=(server.url, SYSTEM + [7] * 10))
    second = threading.Thread(target=complete, args=(server.url, SYSTEM + [9] * 30))
    try:
        first.start()
        wait_until(lambda: blocks(server.url)["stats"]["num_waiting"] == 1)
        gate.run(1)  # the first prompt is computed: its full blocks enter the prefix cache
        second.start()
        wait_until(lambda: blocks(server.url)["stats"]["num_waiting"] == 1)
        gate.run(1)  # the second is admitted on top of the first's two system blocks
        view = blocks(server.url)
    finally:
        gate.release()
        first.join()
        second.join()

    a, b = view["sequences"]
    assert (a["num_tokens"], a["num_computed_tokens"], len(a["block_ids"])) == (52, 51, 4)
    assert (b["num_tokens"], b["num_computed_tokens"], len(b["block_ids"])) == (71, 70, 5)
    assert a["block_ids"][:2] == b["block_ids"][:2]
    holders = holders_by_block(view)
    state, ref_cnt = view["blocks"]["state"], view["blocks"]["ref_cnt"]
    for block_id in range(view["num_blocks"]):
        held_by = len(holders.get(block_id, []))
        assert ref_cnt[block_id] == held_by
        assert state[block_id] == ("S" if held_by > 1 else "U" if held_by else state[block_id])
        assert (state[block_id] in "FC") == (held_by == 0)
    assert [state[i] for i in b["block_ids"]] == ["S", "S", "U", "U", "U"]
    assert view["block_counts"]["shared"] == 2 and view["block_counts"]["in_use"] == 5
    assert view["stats"]["num_used_blocks"] == 7 and view["stats"]["num_running"] == 2


def test_idle_view_equals_the_engines_stats(server, engine):
    complete(server.url, SYSTEM + [5] * 30, max_tokens=8)
    complete(server.url, SYSTEM + [6] * 3, max_tokens=8)  # reuses the system blocks
    view = blocks(server.url)
    assert view["stats"] == engine.stats()  # the engine is idle: reading it from here is safe
    stats, counts = view["stats"], view["block_counts"]
    assert stats["prefix_cache_hits"] > 0
    assert counts == {"free": view["blocks"]["state"].count("F"), "cached": view["blocks"]["state"].count("C"),
                      "in_use": 0, "shared": 0}
    assert counts["cached"] == stats["num_cached_blocks"] > 0
    assert counts["free"] + counts["cached"] == stats["num_free_blocks"] == view["num_blocks"]
    assert view["sequences"] == [] and set(view["blocks"]["ref_cnt"]) == {0}
    assert sorted(view["blocks"]["free_rank"]) == list(range(view["num_blocks"]))
    assert view["capacity"] == engine.capacity_line() and view["capacity"].startswith("KV cache (float32): ")
    assert (view["kv_cache_dtype"], view["block_size"], view["model"]) == ("float32", 16, "tiny-chat")
    assert view["kv_cache"] == engine.kv_cache_info()


def test_pages_are_served_whole_and_load_nothing_from_elsewhere(server):
    index = httpx.get(server.url + "/")
    assert index.status_code == 200 and 'href="/dashboard"' in index.text
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "/v1/kv/blocks" in page.text and "<canvas" in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # no CDN, no external asset


def test_history_keeps_samples_and_filters_by_time(server):
    def sample_times(query: str = "") -> list[float]:
        return [sample["time"] for sample in httpx.get(server.url + "/v1/kv/history" + query).json()["samples"]]

    assert httpx.get(server.url + "/v1/kv/history").json()["interval_s"] == 1.0
    times = sample_times()  # one sample at start-up, then one a second
    assert times and times == sorted(times)
    assert sample_times(f"?after={times[0]}")[: len(times) - 1] == times[1:]  # (newer ones may have come since)
    assert all(time_s > times[-1] for time_s in sample_times(f"?after={times[-1]}"))
    bad = httpx.get(server.url + "/v1/kv/history?after=yesterday")
    assert bad.status_code == 400 and "after='yesterday' is not a number" in bad.json()["error"]["message"]


def test_history_rates_cover_the_time_between_samples():
    stats = dict(kv_cache_usage=0.25, num_running=2, num_waiting=1, num_prefill_tokens=100, num_decode_tokens=10,
                 prefix_cache_queries=0, prefix_cache_hits=0)
    history = StatsHistory(lambda: dict(stats), max_samples=2)
    history.sample(10.0)
    stats.update(num_prefill_tokens=400, num_decode_tokens=50, prefix_cache_queries=200, prefix_cache_hits=150)
    history.sample(12.0)
    first, second = history.samples_after(0)
    assert first["prefill_tokens_per_s"] == 0.0 and first["prefix_cache_hit_rate"] is None
    assert (second["prefill_tokens_per_s"], second["decode_tokens_per_s"]) == (150.0, 20.0)
    assert second["prefix_cache_hit_rate"] == 0.75 and second["num_waiting"] == 1
    history.sample(13.0)  # no lookups in that second: no hit rate, not 0
    assert [s["time"] for s in history.samples_after(0)] == [12.0, 13.0]  # only the newest two are kept
    assert history.samples_after(12.0)[0]["prefix_cache_hit_rate"] is None


def test_history_shows_the_disk_tiers_fill_and_hit_rate():
    stats = dict(kv_cache_usage=0.0, num_running=0, num_waiting=0, num_prefill_tokens=0, num_decode_tokens=0,
                 prefix_cache_queries=0, prefix_cache_hits=0, disk_cache_bytes=0, disk_cache_capacity_bytes=1000,
                 disk_cache_hit_tokens=0)
    history = StatsHistory(lambda: dict(stats))
    history.sample(10.0)
    stats.update(prefix_cache_queries=200, prefix_cache_hits=150, disk_cache_hit_tokens=100, disk_cache_bytes=250)
    history.sample(11.0)
    first, second = history.samples_after(0)
    assert (first["disk_cache_fill"], first["disk_cache_hit_rate"]) == (0.0, None)
    assert (second["disk_cache_fill"], second["disk_cache_hit_rate"]) == (0.25, 0.5)
    without = StatsHistory(lambda: {k: v for k, v in stats.items() if not k.startswith("disk")})
    without.sample(1.0)
    assert not any(key.startswith("disk") for key in without.samples_after(0)[0])


def test_kv_blocks_pollers_share_one_view_at_most_every_max_age(model_dir):
    # Sixteen pollers back to back once took a view each on the engine thread, between every two steps.
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    with ServerThread(build_app(engine, kv_blocks_max_age_s=0.5)) as server:
        shared = server.server.config.app.state.kv_blocks
        stream = threading.Thread(target=complete, args=(server.url, [7] * 20, 300))
        stream.start()
        views, start = [], time.monotonic()

        def poll():
            with httpx.Client(base_url=server.url) as client:
                while time.monotonic() - start < 1.2:
                    views.append(client.get("/v1/kv/blocks").json())

        pollers = [threading.Thread(target=poll) for _ in range(16)]
        for thread in pollers:
            thread.start()
        for thread in pollers:
            thread.join()
        stream.join()
        time.sleep(0.5)
        fresh = blocks(server.url)
    times = sorted({view["time"] for view in views})
    assert len(views) > 4 * len(times)  # many polls, few views
    assert len(times) <= 4 and shared.num_taken == len(times) + 1  # 1.2 s of polls: a view per 0.5 s; + fresh
    assert all(b - a >= 0.45 for a, b in zip(times, times[1:]))  # wall-clock stamps of 0.5 s monotonic gaps
    assert fresh["time"] > times[-1] and fresh["stats"]["num_running"] == 0  # an old view is not kept


def test_many_pollers_of_metrics_and_the_dashboard_cost_a_bounded_number_of_computations(model_dir):
    """Issue 57: 64 clients polling /metrics, /v1/kv/blocks and /v1/kv/history back to back once kept the event
    loop busy enough to slow a stream about 3x. However many poll, the engine's stats are taken once per block view
    (and once more as the engine thread publishes them after that call), each view, /metrics rendering and history
    copy at most once per max age, and a poller gets one answer per route and max age (no timing asserted)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    max_age_s, routes = 0.5, ("/metrics", "/v1/kv/blocks", "/v1/kv/history")
    app = build_app(engine, kv_blocks_max_age_s=max_age_s, metrics_max_age_s=max_age_s)
    with ServerThread(app) as server:
        stats, num_stats_calls = engine.stats, [0]

        def counted_stats():
            num_stats_calls[0] += 1
            return stats()

        engine.stats = counted_stats
        clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(64)]  # made before the clock runs
        answers, start = [], time.monotonic()

        def poll(client: httpx.Client):
            while True:  # a round at least, then until 1.2 s have passed
                answers.extend(client.get(route).status_code for route in routes)
                if time.monotonic() - start > 1.2:
                    return

        pollers = [threading.Thread(target=poll, args=(client,)) for client in clients]
        for thread in pollers:
            thread.start()
        for thread in pollers:
            thread.join()
        elapsed_s, num_polled_stats_calls = time.monotonic() - start, num_stats_calls[0]
        for client in clients:
            client.close()
    shared = [app.state.kv_blocks, app.state.metrics, app.state.kv_history]
    most = int(elapsed_s / max_age_s) + 2  # one at once, then one per max age (+1: the last may start at the end)
    assert answers.count(200) == len(answers) >= 64 * len(routes)
    assert all(1 <= view.num_taken <= most for view in shared), [view.num_taken for view in shared]
    assert num_polled_stats_calls <= 2 * app.state.kv_blocks.num_taken
    assert len(answers) <= 64 * len(routes) * most  # each poller waited for its answers


def test_the_kv_routes_need_the_api_key_and_the_page_asks_for_it(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    with ServerThread(build_app(engine, api_key="sesame")) as server:
        for route in ("/v1/kv/blocks", "/v1/kv/history"):
            assert httpx.get(server.url + route).status_code == 401
            wrong = httpx.get(server.url + route, headers={"Authorization": "Bearer open"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(server.url + route, headers={"Authorization": "Bearer sesame"}).status_code == 200
        page = httpx.get(server.url + "/dashboard")  # the page is static code: it holds no data, it asks for the key
        assert page.status_code == 200 and "tiny-chat" not in page.text and 'type="password"' in page.text


def test_a_failed_engine_answers_503(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    with ServerThread(build_app(engine)) as server:
        assert blocks(server.url)["stats"]["num_running"] == 0

        def broken_step():
            raise RuntimeError("injected fault")

        engine.step = broken_step
        failed_request = httpx.post(server.url + "/v1/completions", json={"model": "tiny-chat", "prompt": "hi"})
        assert failed_request.status_code == 503
        failed = httpx.get(server.url + "/v1/kv/blocks")
        assert failed.status_code == 503 and "injected fault" in failed.json()["error"]["message"]


def test_the_engine_thread_answers_calls_and_outlives_a_failing_one(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))

    async def calls():
        async_engine = AsyncEngine(engine, max_waiting=4)
        async_engine.start()
        try:
            assert await async_engine.call(lambda e: e.kv.pool.num_blocks) == 128
            with pytest.raises(ZeroDivisionError):
                await async_engine.call(lambda e: 1 / 0)
            assert await async_engine.call(lambda e: e.stats()) == engine.stats()
        finally:
            async_engine.shutdown()

    asyncio.run(calls())


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
