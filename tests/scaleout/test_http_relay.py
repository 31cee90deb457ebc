"""A relayed exchange is the single server's: the replica runs the request through the kvserve app in-process
(status, headers, streamed pieces unchanged); a client leaving mid-stream aborts the engine request; a replica lost
mid-stream ends the client's event stream with a 503 error event, as an engine failure does."""
import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from kvserve import EngineConfig, LLMEngine
from kvserve.scaleout.http_relay import ForwardedRequest, RelayedResponse, ResponseStart, call_app
from kvserve.server.app import build_app
from kvserve.server.errors import APIError
from tests.conftest import make_tiny_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("relay") / "tiny-chat")


def post(path: str, body: dict) -> ForwardedRequest:
    return ForwardedRequest("POST", path, b"", ((b"content-type", b"application/json"),), json.dumps(body).encode())


def run_with_app(model_dir, scenario):
    """Run `scenario(app, engine)` on a started kvserve app, as a replica does."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="64MiB", max_model_len=1024))
    app = build_app(engine)

    async def main():
        async with app.router.lifespan_context(app):
            return await scenario(app, engine)

    return asyncio.run(main())


async def collect(parts) -> tuple[ResponseStart, bytes]:
    start, body = None, b""
    async for part in parts:
        if isinstance(part, ResponseStart):
            start, body = part, part.body
        else:
            body += part
    return start, body


def test_a_plain_answer_comes_whole_with_the_apps_status_and_headers(model_dir):
    async def scenario(app, engine):
        return await collect(call_app(app, post("/v1/completions", {"prompt": "hi there", "max_tokens": 3}), "r1"))

    start, body = run_with_app(model_dir, scenario)
    assert (start.status, start.replica) == (200, "r1")
    assert (b"content-type", b"application/json") in start.headers
    assert json.loads(body)["usage"]["completion_tokens"] == 3


def test_errors_pass_through_unchanged(model_dir):
    async def scenario(app, engine):
        return await collect(call_app(app, post("/v1/completions", {"prompt": "hi", "max_tokens": -1}), "r1"))

    start, body = run_with_app(model_dir, scenario)
    assert start.status == 400
    assert json.loads(body)["error"]["param"] == "max_tokens"


def test_a_stream_arrives_in_pieces_and_ends_with_done(model_dir):
    request = {"prompt": "hi", "max_tokens": 5, "ignore_eos": True, "temperature": 0.0}

    async def scenario(app, engine):
        parts = [p async for p in call_app(app, post("/v1/completions", {**request, "stream": True}), "r1")]
        _, whole = await collect(call_app(app, post("/v1/completions", request), "r1"))
        return parts, json.loads(whole)["choices"][0]["text"]

    parts, whole = run_with_app(model_dir, scenario)
    assert isinstance(parts[0], ResponseStart) and len(parts) >= 3  # the head, pieces as they come, [DONE]
    text = parts[0].body + b"".join(parts[1:])
    assert text.endswith(b"data: [DONE]\n\n")
    events = [json.loads(event[len(b"data: "):]) for event in text.split(b"\n\n") if event.startswith(b"data: {")]
    # An event holds a request's latest output: one per token, or several tokens in one when the reader was slower
    # than the engine's steps (async_engine keeps only the latest). Either way every token's text arrives.
    assert 1 <= len(events) <= 5 and all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_closing_the_relay_mid_stream_aborts_the_engine_request(model_dir):
    async def scenario(app, engine):
        parts = call_app(app, post("/v1/completions", {"prompt": "hi", "max_tokens": 500, "stream": True,
                                                       "ignore_eos": True}), "r1")
        await parts.__anext__()
        await parts.__anext__()
        await parts.aclose()  # what the ingress does when its client leaves
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return engine.has_unfinished_requests()

    assert run_with_app(model_dir, scenario) is False  # and the leak check after the test finds every block back


class ReplicaLost(Exception):
    pass


async def lost_after_one_piece():
    yield b'data: {"choices": []}\n\n'
    raise ReplicaLost("The actor died unexpectedly before finishing this task.")


@pytest.mark.parametrize("content_type, expect_error_event", [(b"text/event-stream", True),
                                                              (b"application/json", False)])
def test_a_replica_lost_mid_stream_ends_an_event_stream_with_a_503_event(content_type, expect_error_event):
    closed = []
    start = ResponseStart(200, ((b"content-type", content_type),), b"data: first\n\n", "r7")

    async def endpoint(request):
        lost = lambda exc: APIError(503, f"replica r7 was lost: {exc}", code="replica_unavailable")  # noqa: E731
        return RelayedResponse(start, lost_after_one_piece(), lost, (ReplicaLost,), lambda: closed.append(True))

    async def main():
        transport = httpx.ASGITransport(Starlette(routes=[Route("/", endpoint)]))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/")

    response = asyncio.run(main())
    assert response.status_code == 200 and response.headers["x-kvserve-replica"] == "r7"
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[:2] == ["first", '{"choices": []}']
    if expect_error_event:
        error = json.loads(events[2])["error"]
        assert error["code"] == "replica_unavailable" and "died unexpectedly" in error["message"]
        assert events[3:] == ["[DONE]"]
    else:
        assert len(events) == 2
    assert closed == [True]
