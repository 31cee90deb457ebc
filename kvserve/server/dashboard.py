"""The KV cache dashboard: `GET /dashboard`, a self-contained page that polls `GET /v1/kv/blocks` (the block pool
and the engine's stats at one moment) and `GET /v1/kv/history` (a sample a second over the last five minutes).

The block view is taken on the engine thread between two steps, only when someone asks, so an unwatched
server pays nothing, and at most once per KV_BLOCKS_MAX_AGE_S however many pages poll: they share one view,
encoded once. The history only copies the stats the engine thread already publishes after each step, and its
pollers too get one answer per KV_BLOCKS_MAX_AGE_S (shared_view.py)."""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv.snapshot import BLOCK_STATES, snapshot_pool
from kvserve.server.async_engine import AsyncEngine, EngineDeadError
from kvserve.server.errors import bad_request, engine_unavailable
from kvserve.server.shared_view import SharedView

FORMAT_VERSION = 1  # of /v1/kv/blocks and /v1/kv/history: fields may be added; a change of meaning bumps it
HISTORY_INTERVAL_S = 1.0
HISTORY_SAMPLES = 300  # five minutes
# The page's refresh: however many pages poll, one view a second (a poll that comes sooner waits for the next).
KV_BLOCKS_MAX_AGE_S = 1.0
NO_STORE = {"Cache-Control": "no-store"}
# The page loads nothing from anywhere: its script and style are inline and it talks only to this server.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
}


def engine_view(engine: LLMEngine, model_name: str) -> dict[str, Any]:
    """The body of GET /v1/kv/blocks. Reads the engine's live state: call it on the engine thread only."""
    return {**fixed_view(engine, model_name), **live_view(engine)}


def fixed_view(engine: LLMEngine, model_name: str) -> dict[str, Any]:
    """The fields of the view that never change while the engine runs."""
    return {
        "format_version": FORMAT_VERSION,
        "model": model_name,
        "kv_cache_dtype": engine.config.kv_cache_format,
        "kv_cache": engine.kv_cache_info(),
        "block_size": engine.kv.block_size,
        "num_blocks": engine.kv.pool.num_blocks,
        "capacity": engine.capacity_line(),
        "block_states": BLOCK_STATES,
    }


def live_view(engine: LLMEngine) -> dict[str, Any]:
    """The fields that describe this moment: all the engine thread computes for a view."""
    snapshot = snapshot_pool(engine.kv.pool)
    sequences = [
        {"request_id": seq.request_id, "num_tokens": len(seq.token_ids), "num_computed_tokens": seq.num_computed_tokens,
         "block_ids": engine.kv.block_ids(seq.request_id)}
        for seq in engine.scheduler.running
    ]
    return {
        "time": time.time(),
        "stats": engine.stats(),
        "block_counts": {name: snapshot.count(name) for name in BLOCK_STATES.values()},
        "blocks": {"state": snapshot.states, "ref_cnt": snapshot.ref_cnts, "free_rank": snapshot.free_ranks},
        "sequences": sequences,
    }


def shared_blocks(async_engine: AsyncEngine, fixed: dict[str, Any], max_age_s: float) -> SharedView[bytes]:
    """The encoded body of GET /v1/kv/blocks, one view shared by every poller (shared_view.py); none once the
    engine has failed."""

    async def take() -> bytes:
        live = await async_engine.call(live_view)
        # encoded once per view, here, the way JSONResponse would
        return json.dumps({**fixed, **live}, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8")

    return SharedView(take, max_age_s, lambda: _raise_if_dead(async_engine))


def _raise_if_dead(async_engine: AsyncEngine) -> None:
    if async_engine.error is not None:
        raise EngineDeadError(async_engine.error)


class StatsHistory:
    """The engine's stats sampled every `interval_s` while the app runs, `max_samples` kept: usage, queue
    lengths, and the token and prefix-hit rates over each interval; with a disk tier, its fill and the share of
    looked-up prompt tokens it supplied."""

    def __init__(self, stats: Callable[[], dict[str, Any]], interval_s: float = HISTORY_INTERVAL_S,
                 max_samples: int = HISTORY_SAMPLES):
        self.interval_s = interval_s
        self._stats = stats
        self._samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._previous: tuple[float, dict[str, Any]] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            self.sample(time.time())
            await asyncio.sleep(self.interval_s)

    def sample(self, now: float) -> None:
        """Record the stats as of `now`; rates cover the time since the previous sample."""
        stats = self._stats()
        sample = {"time": now, "kv_cache_usage": stats["kv_cache_usage"], "num_running": stats["num_running"],
                  "num_waiting": stats["num_waiting"], "prefill_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0,
                  "prefix_cache_hit_rate": None}
        if self._previous is not None:
            then, before = self._previous
            elapsed_s = max(now - then, 1e-9)
            sample["prefill_tokens_per_s"] = (stats["num_prefill_tokens"] - before["num_prefill_tokens"]) / elapsed_s
            sample["decode_tokens_per_s"] = (stats["num_decode_tokens"] - before["num_decode_tokens"]) / elapsed_s
            queries = stats["prefix_cache_queries"] - before["prefix_cache_queries"]
            if queries:
                sample["prefix_cache_hit_rate"] = (stats["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries
                if "disk_cache_hit_tokens" in stats:  # the share of looked-up prompt tokens the disk tier supplied
                    sample["disk_cache_hit_rate"] = (stats["disk_cache_hit_tokens"]
                                                     - before["disk_cache_hit_tokens"]) / queries
        if "disk_cache_capacity_bytes" in stats:  # --kv-disk-cache: how full the tier is, and its hits
            sample["disk_cache_fill"] = stats["disk_cache_bytes"] / max(stats["disk_cache_capacity_bytes"], 1)
            sample.setdefault("disk_cache_hit_rate", None)
        self._previous = (now, stats)
        self._samples.append(sample)

    def samples_after(self, after: float) -> list[dict[str, Any]]:
        """Samples taken strictly after the unix time `after`, oldest first."""
        return [sample for sample in self._samples if sample["time"] > after]


def add_dashboard_routes(app: FastAPI, async_engine: AsyncEngine, history: StatsHistory, model_name: str,
                         auth, kv_blocks_max_age_s: float = KV_BLOCKS_MAX_AGE_S) -> None:
    """GET / (links), GET /dashboard (the page) and the two JSON routes behind `auth`; pollers of /v1/kv/blocks
    share a view up to `kv_blocks_max_age_s` old (app.state.kv_blocks)."""
    shared = app.state.kv_blocks = shared_blocks(async_engine, fixed_view(async_engine.engine, model_name),
                                                 kv_blocks_max_age_s)

    async def all_samples() -> list[dict[str, Any]]:
        return history.samples_after(0.0)

    # the history changes once a sample; its pollers share one copy of the samples, as the block view's do
    samples = app.state.kv_history = SharedView(all_samples, kv_blocks_max_age_s)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse(_static("index.html"))

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(_static("dashboard.html"), headers=PAGE_HEADERS)

    @app.get("/v1/kv/blocks", dependencies=[Depends(auth)])
    async def kv_blocks() -> Response:
        try:
            body = await shared.value()
        except EngineDeadError as exc:
            raise engine_unavailable(str(exc)) from exc
        return Response(body, media_type="application/json", headers=NO_STORE)

    @app.get("/v1/kv/history", dependencies=[Depends(auth)])
    async def kv_history(request: Request) -> Response:
        after = _float_param(request, "after", 0.0)
        body = {"format_version": FORMAT_VERSION, "interval_s": history.interval_s,
                "samples": [sample for sample in await samples.value() if sample["time"] > after]}
        return JSONResponse(body, headers=NO_STORE)


def _float_param(request: Request, name: str, default: float) -> float:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise bad_request(f"{name}={text!r} is not a number (a unix time in seconds)", name) from None


@cache
def _static(name: str) -> str:
    return resources.files("kvserve.server").joinpath("static", name).read_text(encoding="utf-8")
