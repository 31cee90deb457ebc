"""One HTTP exchange carried over Ray: the ingress packs the request, the replica runs it through the unchanged
kvserve FastAPI app in-process (so paths, validation, errors, auth and streaming are the single server's), and the
ingress streams the answer back to its client."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError
from kvserve.server.generation import SSE_DONE, sse

logger = logging.getLogger("kvserve")
Headers = tuple[tuple[bytes, bytes], ...]
APP_EXIT_WAIT_S = 5.0  # after the client left, how long the app gets to abort its requests before it is cancelled


@dataclass(frozen=True)
class ForwardedRequest:
    """What the ingress sends a replica: the HTTP request, and the routing keys its router matched on."""

    method: str
    path: str
    query_string: bytes
    headers: Headers
    body: bytes
    routing_keys: tuple[bytes, ...] = ()

    @classmethod
    async def from_request(cls, request: Request, routing_keys: tuple[bytes, ...] = ()) -> ForwardedRequest:
        return cls(request.method, request.url.path, request.url.query.encode(), tuple(request.headers.raw),
                   await request.body(), routing_keys)


@dataclass(frozen=True)
class ResponseStart:
    """The first part of a replica's answer: status, headers and the first piece of the body."""

    status: int
    headers: Headers
    body: bytes
    replica: str  # which replica answered, also sent to the client as the x-kvserve-replica header


async def call_app(app: ASGIApp, request: ForwardedRequest, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through `app` in this process: a ResponseStart, then body pieces as the app sends them. Closing
    the iterator early tells the app its client disconnected (it aborts what it started)."""
    scope = _scope(request)
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    client_gone = asyncio.Event()
    task = asyncio.ensure_future(app(scope, _receiver(request.body, client_gone), sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        start: dict | None = None
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                start = message
                continue
            body, more = message.get("body", b""), message.get("more_body", False)
            if start is not None:
                yield ResponseStart(start["status"], tuple(start.get("headers", ())), body, replica)
                start = None
            elif body:
                yield body
            if not more:
                return
        task.result()  # the app ended without answering: raise what it raised
        raise RuntimeError(f"the app sent no response to {request.method} {request.path}")
    finally:
        client_gone.set()
        await _settle(task)


def _scope(request: ForwardedRequest) -> Scope:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query_string, "root_path": "", "headers": list(request.headers),
        "client": None, "server": None,
    }


def _receiver(body: bytes, client_gone: asyncio.Event) -> Callable[[], Awaitable[dict]]:
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await client_gone.wait()  # the body is read: the next message can only be the client leaving
        return {"type": "http.disconnect"}

    return receive


async def _settle(task: asyncio.Future) -> None:
    done, _ = await asyncio.wait({task}, timeout=APP_EXIT_WAIT_S)
    if not done:
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled() and task.exception() is not None:
        logger.error("the kvserve app failed: %r", task.exception())


class RelayedResponse(Response):
    """Streams a replica's answer to the client. If the replica dies mid-stream, an event stream ends with the
    error event the single server sends when its engine dies; any other body just ends."""

    def __init__(self, start: ResponseStart, rest: AsyncIterator[bytes],
                 on_replica_lost: Callable[[BaseException], APIError], replica_errors: tuple[type[BaseException], ...],
                 close: Callable[[], None]):
        super().__init__(status_code=start.status)
        self.raw_headers = [*start.headers, (b"x-kvserve-replica", start.replica.encode())]
        self._start, self._rest = start, rest
        self._on_replica_lost, self._replica_errors, self._close = on_replica_lost, replica_errors, close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self._start.body, "more_body": True})
            try:
                async for chunk in self._rest:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except self._replica_errors as exc:
                if self.headers.get("content-type", "").startswith("text/event-stream"):
                    error = self._on_replica_lost(exc)
                    await send({"type": "http.response.body", "body": (sse(error.body()) + SSE_DONE).encode(),
                                "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._close()
