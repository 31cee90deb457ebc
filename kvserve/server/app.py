"""The FastAPI app: OpenAI-compatible routes over one background engine, plus /health, /metrics and /version."""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.engine import tool_parsers
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.api_models import ChatCompletionRequest, CompletionRequest, parse_request
from kvserve.server.async_engine import DEFAULT_MAX_WAITING, AsyncEngine
from kvserve.server.body import DEFAULT_MAX_BODY_BYTES, read_json_body
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.dashboard import KV_BLOCKS_MAX_AGE_S, StatsHistory, add_dashboard_routes
from kvserve.server.errors import APIError, engine_unavailable, unauthorized
from kvserve.server.generation import ServingContext
from kvserve.server.hosts import HostCheck
from kvserve.server.metrics import METRICS_MAX_AGE_S, ServerMetrics
from kvserve.server.shared_view import SharedView

logger = logging.getLogger("kvserve")


def build_app(engine: LLMEngine, served_model_name: str | None = None, api_key: str | None = None,
              max_waiting: int = DEFAULT_MAX_WAITING, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              allowed_hosts: Sequence[str] = (), chat_content_special_tokens: bool = False,
              kv_blocks_max_age_s: float = KV_BLOCKS_MAX_AGE_S,
              metrics_max_age_s: float = METRICS_MAX_AGE_S, tool_call_parser: str = "auto",
              auto_tool_choice: bool = True) -> FastAPI:
    """An app serving `engine` as `served_model_name`; the engine thread (app.state.engine) runs while the app's
    lifespan does. With `api_key`, every route but /health, /metrics and /version needs `Authorization: Bearer
    <api_key>`. A request that finds `max_waiting` sequences already queued for the engine gets 503; a body over
    `max_body_bytes` gets 413. Without `api_key`, on a loopback address, a Host that is neither local nor in
    `allowed_hosts` gets 403. `chat_content_special_tokens` parses special-token text in chat messages as the
    tokens themselves (as before issue 31; it lets a message forge template markers). Pollers of /v1/kv/blocks
    and /v1/kv/history share one view up to `kv_blocks_max_age_s` old, scrapers of /metrics one rendering up to
    `metrics_max_age_s` old (a poll that comes sooner waits for the next). Tool calls are written and parsed in
    the format `tool_call_parser` names ("auto": the chat template's own, else kvserve's default:
    kvserve/engine/tool_parsers/); without `auto_tool_choice`, tool_choice "auto" is a 400, as in vLLM without
    --enable-auto-tool-choice."""
    if max_waiting < 1:
        raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
    if api_key is not None and not api_key.strip():  # an empty key would lock everyone out (or, ignored, no one)
        raise ValueError("api_key is empty; give a non-empty key, or none to serve without one")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
    model_name = served_model_name or engine.model_name
    # Each needs the other: the metrics read the engine thread's stats, the engine thread feeds the metrics.
    metrics = ServerMetrics(model_name, lambda: async_engine.stats(), engine.kv_cache_info())
    async_engine = AsyncEngine(engine, max_waiting, metrics.observe)
    tool_format = tool_parsers.for_tokenizer(tool_call_parser, engine.tokenizer, engine.eos_token_ids)
    ctx = ServingContext(async_engine, model_name, engine.tokenizer, chat_content_special_tokens, tool_format,
                         auto_tool_choice)
    history = StatsHistory(async_engine.stats)
    auth = _api_key_check(api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info(f"kvserve {__version__} serving {model_name}")
        async_engine.start()
        history.start()
        yield
        history.stop()
        async_engine.shutdown()

    # The docs routes are added below, behind the key like /v1.
    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = async_engine
    app.add_middleware(HostCheck, api_key=api_key, allowed_hosts=allowed_hosts)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    auth = _api_key_check(api_key)
    _add_open_routes(app, async_engine, metrics, metrics_max_age_s)
    _add_docs_routes(app, auth)
    _add_v1_routes(app, ctx, engine.max_model_len, auth, max_body_bytes)
    add_dashboard_routes(app, async_engine, history, model_name, auth, kv_blocks_max_age_s)
    return app


def _add_open_routes(app: FastAPI, async_engine: AsyncEngine, metrics: ServerMetrics,
                     metrics_max_age_s: float) -> None:
    async def render() -> bytes:
        return metrics.render()

    rendered = app.state.metrics = SharedView(render, metrics_max_age_s)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.error is not None:
            return engine_unavailable(async_engine.error).response()
        return JSONResponse({})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await rendered.value(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})  # vLLM's /version


def _add_docs_routes(app: FastAPI, auth) -> None:
    @app.get("/openapi.json", dependencies=[Depends(auth)], include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=[Depends(auth)], include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvserve")

    @app.get("/redoc", dependencies=[Depends(auth)], include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="kvserve")


def _add_v1_routes(app: FastAPI, ctx: ServingContext, max_model_len: int, auth, max_body_bytes: int) -> None:
    created = int(time.time())

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> Response:
        card = {"id": ctx.model_name, "object": "model", "created": created, "owned_by": "kvserve",
                "root": ctx.model_name, "max_model_len": max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await read_json_body(request, max_body_bytes))
        return await create_completion(ctx, req, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await read_json_body(request, max_body_bytes))
        return await create_chat_completion(ctx, req, request)


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # The scheme is case-insensitive (RFC 9110); compare_digest takes as long whatever the key's prefix.
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise unauthorized()

    return check


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    # Unknown routes and wrong methods answer in the same error shape as everything else.
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
    return error.response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    # A bug, not the client's fault: say so in the usual shape (the traceback goes to the server log).
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()
