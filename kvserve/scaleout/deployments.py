"""The two Ray Serve deployments behind the endpoint.

EngineReplica: one LLMEngine with the single server's FastAPI app, run in-process for each relayed request; it
publishes its cached block keys to the routers (Serve's routing stats) and reports health and metrics on request.
Ingress: the HTTP endpoint. /health and /metrics cover all replicas; every other request gets its routing keys and
is relayed to the replica its router picks; a replica lost mid-request becomes a 503 naming the cause."""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.scaleout.config import ScaleOutConfig
from kvserve.scaleout.http_relay import ForwardedRequest, RelayedResponse, ResponseStart, call_app
from kvserve.scaleout.metrics import merge_replica_metrics
from kvserve.scaleout.published_blocks import PublishedBlocks
from kvserve.scaleout.request_keys import CHAT_PATH, COMPLETIONS_PATH, RequestKeys
from kvserve.scaleout.routers import ROUTERS
from kvserve.server.errors import APIError, engine_unavailable
from kvserve.server.launch import BACKSTOP_S

logger = logging.getLogger("kvserve")
ROUTING_STATS_PERIOD_S = 1.0  # how often replicas publish their cached block keys to the routers
RECENT_ROUTES_TTL_S = 10.0  # how long a router counts a routed prompt as cached before the replica's snapshot shows it
HEALTH_CHECK_PERIOD_S = 2.0  # an engine that failed is restarted by Serve after three failed checks
REPORT_TIMEOUT_S = 5.0  # /health and /metrics wait this long for the replicas
DASHBOARD_PATHS = ("/", "/dashboard", "/v1/kv/blocks", "/v1/kv/history")
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)


class EngineReplica:
    """A Serve replica holding one engine (and so one KV cache)."""

    async def __init__(self, config: ScaleOutConfig):
        import torch

        from kvserve.engine.llm_engine import LLMEngine
        from kvserve.server.app import build_app

        torch.set_num_threads(max(1, int(config.replica_cpus)))
        engine = LLMEngine(config.engine)
        self._blocks = PublishedBlocks(engine.kv.pool)
        self._capacity_blocks = engine.kv.pool.num_blocks
        self._app = build_app(engine, config.served_model_name, config.api_key, config.max_waiting,
                              config.max_body_bytes, config.allowed_hosts, config.chat_content_special_tokens,
                              tool_call_parser=config.tool_call_parser, auto_tool_choice=config.auto_tool_choice)
        self._lifespan = self._app.router.lifespan_context(self._app)
        await self._lifespan.__aenter__()
        self._id = serve.get_replica_context().replica_id.unique_id
        self._keys, self._version = b"", 0

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to one relayed request; cancelling it is the client leaving."""
        self._blocks.start_serving(request.routing_keys)
        try:
            async for part in call_app(self._app, request, self._id):
                yield part
        finally:
            self._blocks.stop_serving(request.routing_keys)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the routers learn every ROUTING_STATS_PERIOD_S: the keys of the blocks cached or being prefilled, and
        how many blocks the cache has."""
        keys = self._blocks.snapshot()
        if keys != self._keys:
            self._keys, self._version = keys, self._version + 1
        return {"version": self._version, "keys": keys, "capacity_blocks": self._capacity_blocks}

    async def report(self) -> dict[str, Any]:
        """This replica's health and Prometheus metrics, as its own /health and /metrics give them."""
        health_status, health_body = await self._get("/health")
        _, metrics = await self._get("/metrics")
        stats = self._app.state.engine.stats()
        health = {"replica": self._id, "status": "ok" if health_status == 200 else "failed",
                  "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                  "kv_cache_tokens": stats["num_blocks"] * stats["block_size"],
                  **{k: stats[k] for k in ("num_running", "num_waiting", "num_cached_blocks", "kv_cache_usage")}}
        if health_status != 200:
            health["error"] = json.loads(health_body)["error"]["message"]
        return {"replica": self._id, "health": health, "metrics": metrics.decode()}

    async def abort_all(self) -> None:
        """Stop every request now; each client gets a last output with finish_reason "abort" (for shutdown)."""
        self._app.state.engine.abort_all()

    async def check_health(self) -> None:
        """Serve's periodic check: raising marks the replica unhealthy, and Serve replaces it."""
        error = self._app.state.engine.error
        if error is not None:
            raise RuntimeError(f"the engine is not serving: {error}")

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)  # aborts what still runs; the engine thread stops

    async def _get(self, path: str) -> tuple[int, bytes]:
        status, body = 0, b""
        async for part in call_app(self._app, ForwardedRequest("GET", path, b"", (), b""), self._id):
            if isinstance(part, ResponseStart):
                status, body = part.status, part.body
            else:
                body += part
        return status, body


class Ingress:
    """The endpoint's HTTP side (Serve's proxy hands it every request)."""

    def __init__(self, engine: DeploymentHandle, config: ScaleOutConfig):
        self._engine = engine.options(stream=True)
        self._reports = engine.options(stream=False)
        self._config = config
        self._keys = RequestKeys(_load_tokenizer(config), config.engine)
        self._in_flight = _InFlight()
        self._draining = False

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        try:
            if request.method == "GET" and path == "/health":
                return await self._health()
            if request.method == "GET" and path == "/metrics":
                return await self._metrics()
            if self._draining:
                raise engine_unavailable("the server is shutting down")
            if path in DASHBOARD_PATHS:
                return _dashboard_unavailable(path)
            return await self._relay(request)
        except APIError as exc:
            return exc.response()
        except Exception as exc:  # a bug, not the client's fault: say so in the usual shape, as the single server
            logger.exception("the ingress failed on %s %s", request.method, path)
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    async def drain(self, timeout_s: float) -> int:
        """Shutting down: refuse new requests, give running ones `timeout_s` to finish, then abort the rest through
        the engines, so their clients get finish_reason "abort" and a proper end; returns how many were aborted."""
        self._draining = True
        if await self._in_flight.wait_idle(timeout_s):
            return 0
        num_aborted = self._in_flight.count
        await self._reports.broadcast("abort_all").results_async(timeout_s=REPORT_TIMEOUT_S, return_exceptions=True)
        await self._in_flight.wait_idle(BACKSTOP_S)
        return num_aborted

    async def _relay(self, request: Request) -> Response:
        path, body = request.url.path, await request.body()
        keys = await asyncio.to_thread(self._keys.keys, path, body) if path in (COMPLETIONS_PATH, CHAT_PATH) else ()
        self._in_flight.enter()
        stream = self._engine.handle.remote(await ForwardedRequest.from_request(request, keys))

        def close() -> None:
            stream.cancel()
            self._in_flight.leave()

        try:
            start = await stream.__anext__()
        except BaseException as exc:
            close()
            if isinstance(exc, REPLICA_LOST):
                raise replica_lost(exc, None) from exc
            raise
        return RelayedResponse(start, stream, lambda exc: replica_lost(exc, start.replica), REPLICA_LOST, close)

    async def _reports_now(self) -> tuple[list[dict], list[str]]:
        try:
            results = await self._reports.broadcast("report").results_async(timeout_s=REPORT_TIMEOUT_S,
                                                                              return_exceptions=True)
        except (DeploymentUnavailableError, TimeoutError) as exc:  # no replica has started (yet)
            results = [exc]
        reports = [r for r in results if isinstance(r, dict)]
        errors = [f"{type(r).__name__}: {_first_line(r)}" for r in results if not isinstance(r, dict)]
        return reports, errors

    async def _health(self) -> Response:
        reports, errors = await self._reports_now()
        replicas = sorted((r["health"] for r in reports), key=lambda h: h["replica"])
        serving = sum(h["status"] == "ok" for h in replicas)
        body = {"status": "ok" if serving == self._config.replicas else "degraded" if serving else "unavailable",
                "replicas_expected": self._config.replicas, "replicas": replicas, "unreachable": errors}
        if serving:
            return JSONResponse(body)
        error = APIError(503, f"no engine replica is serving ({len(replicas)} reported, {len(errors)} unreachable)",
                         code="engine_unavailable", type="server_error")
        return JSONResponse({**error.body(), **body}, status_code=503)

    async def _metrics(self) -> Response:
        reports, _ = await self._reports_now()
        text = merge_replica_metrics({r["replica"]: r["metrics"] for r in reports})
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


class _InFlight:
    """Requests the ingress is relaying, so shutdown can wait for them."""

    def __init__(self):
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


def replica_lost(exc: BaseException, replica: str | None) -> APIError:
    """The 503 a client gets when the replica serving its request dies or becomes unreachable mid-request."""
    which = f"engine replica {replica}" if replica else "engine replica chosen for this request"
    return APIError(503, f"the {which} was lost ({type(exc).__name__}: {_first_line(exc)}); this request is gone, "
                         "retry it: new requests go to the other replicas while Ray restarts that one",
                    code="replica_unavailable", type="server_error", headers={"Retry-After": "1"})


def build_application(config: ScaleOutConfig):
    """The Serve application: the ingress bound to `config.replicas` engine replicas."""
    router = RequestRouterConfig(
        request_router_class=ROUTERS[config.router],
        request_router_kwargs=({"imbalance_threshold": config.imbalance_threshold, "recent_ttl_s": RECENT_ROUTES_TTL_S}
                               if config.router == "prefix" else {}),
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )
    grace_s = config.shutdown_timeout_s
    engine = serve.deployment(EngineReplica).options(
        num_replicas=config.replicas, max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
        request_router_config=router, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=grace_s, logging_config={"enable_access_log": False},
    ).bind(config)
    ingress = serve.deployment(Ingress).options(
        num_replicas=1, max_ongoing_requests=config.replicas * config.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=grace_s,
        logging_config={"enable_access_log": config.access_log},
    ).bind(engine, config)
    return ingress


def _load_tokenizer(config: ScaleOutConfig):
    from kvserve.engine.builder import load_tokenizer as load
    from kvserve.model.loader import resolve_model

    return load(resolve_model(config.engine.model).path)


def _dashboard_unavailable(path: str) -> Response:
    message = (f"{path}: the KV cache dashboard shows one engine's block pool and is not served through the Ray "
               "endpoint, where each replica has its own; /health and /metrics cover every replica")
    return APIError(404, message, code="404").response()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"
