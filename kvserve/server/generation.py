"""What the completion and chat endpoints share: starting the engine requests behind one HTTP request (counted
as waiting, tokenized off the engine thread, then queued), waiting for them or streaming them as server-sent
events (aborting them when the client leaves), usage, token text."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.prompts import PromptType
from kvserve.engine.tool_parsers import ToolFormat
from kvserve.engine.tool_parsers.hermes import Hermes
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, OutputSink,
                                         RequestFailedError, updates)
from kvserve.server.errors import (APIError, bad_request, bad_value, engine_unavailable, model_not_found,
                                   overloaded, request_failed)

SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"


@dataclass(frozen=True)
class ServingContext:
    """What a handler needs besides its request."""

    engine: AsyncEngine
    model_name: str
    tokenizer: Any  # HF tokenizer or None; used here only to render token text (decode is read-only)
    content_special_tokens: bool = False  # chat content's special-token text parsed as special tokens (unsafe)
    tool_format: ToolFormat = field(default_factory=lambda: Hermes(native=False))  # chosen once, at start
    auto_tool_choice: bool = True  # tool_choice "auto" served (vLLM needs --enable-auto-tool-choice for it)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)


@dataclass
class Generation:
    """The engine requests (one per prompt) behind one HTTP request; outputs of all arrive on one queue."""

    id: str
    created: int
    request_ids: list[str]
    outputs: OutputSink


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def header(ctx: ServingContext, generation: Generation, object_name: str) -> dict[str, Any]:
    """The fields every response and chunk of one generation starts with."""
    return {"id": generation.id, "object": object_name, "created": generation.created, "model": ctx.model_name}


async def start(ctx: ServingContext, id_: str, prompts: list[str | list[int]], cache_salt: str | None,
                params: SamplingParams, fields: set[str], prompt_param: str) -> Generation:
    """Queue every prompt, or none: a bad prompt aborts the ones queued before it and raises a 4xx. The prompts
    count as waiting from the start (503 when the queue is full), and text is tokenized off the engine thread."""
    generation = Generation(id_, int(time.time()), [], OutputSink())
    try:
        ctx.engine.reserve(len(prompts), params.n)  # every sample is a sequence to queue
    except ValueError as exc:  # more sequences than the queue ever holds
        raise bad_request(str(exc), "n" if params.n > 1 else prompt_param) from exc
    except (EngineOverloadedError, EngineDeadError) as exc:
        raise _as_api_error(exc, None, fields, prompt_param) from exc
    index, num_unsent = 0, len(prompts)
    try:
        token_ids = []
        for index, prompt in enumerate(prompts):
            token_ids.append(await ctx.engine.token_ids(prompt))
        for index, ids in enumerate(token_ids):
            request_id = f"{id_}-{index}"
            num_unsent -= 1
            await ctx.engine.add_request(request_id, _engine_prompt(ids, cache_salt), params, generation.outputs)
            generation.request_ids.append(request_id)
    except BaseException as exc:  # cancelled too: the client left while its prompts were being queued
        ctx.engine.release(num_unsent, params.n)
        abort(ctx, generation)
        error = _as_api_error(exc, index if len(prompts) > 1 else None, fields, prompt_param)
        if error is None:
            raise
        raise error from exc
    return generation


async def compile_constraint(ctx: ServingContext, params: SamplingParams, param: str) -> None:
    """Compile the request's structured_outputs grammar off the engine thread (the engine then finds it cached);
    a schema or grammar that does not compile is a 400 naming `param`."""
    if params.structured_outputs is None:
        return
    try:
        await ctx.engine.run_in_tokenizer_thread(ctx.engine.engine.grammar, params.structured_outputs)
    except ValueError as exc:
        message = str(exc) if param == "structured_outputs" else re.sub(r"^structured_outputs(\.\w+)?", param, str(exc))
        raise bad_request(message, param) from exc


def _engine_prompt(token_ids: list[int], cache_salt: str | None) -> PromptType:
    return {"prompt_token_ids": token_ids, **({"cache_salt": cache_salt} if cache_salt is not None else {})}


def _as_api_error(exc: BaseException, prompt_index: int | None, fields: set[str], prompt_param: str) -> APIError | None:
    if isinstance(exc, EngineOverloadedError):
        return overloaded(exc.num_waiting)
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, ValueError):
        error = bad_value(exc, fields, prompt_param)
        if prompt_index is not None:
            error.message = f"prompt {prompt_index}: {error.message}"
        return error
    return None


def abort(ctx: ServingContext, generation: Generation) -> None:
    """Stop whatever of it still runs; finished requests are left alone."""
    for request_id in generation.request_ids:
        ctx.engine.abort(request_id)


async def final_outputs(ctx: ServingContext, generation: Generation, request: Request) -> list[RequestOutput] | None:
    """The finished outputs in prompt order, or None if the client went away first (its requests are aborted)."""

    async def collect() -> list[RequestOutput]:
        last: dict[str, RequestOutput] = {}
        async for batch in updates(generation.outputs, generation.request_ids):
            last.update((output.request_id, output) for output in batch)
        return [last[request_id] for request_id in generation.request_ids]

    result = asyncio.ensure_future(collect())
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        return result.result() if result.done() else None
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from exc
    except RequestFailedError as exc:
        raise request_failed(str(exc)) from exc
    finally:
        result.cancel()
        disconnect.cancel()
        abort(ctx, generation)


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the client hanging up.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def event_stream(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events from `events`, then [DONE]; an engine failure, or this request's failure (after its
    chunk with finish_reason "error"), becomes an error event."""
    try:
        async for event in events:
            yield sse(event)
    except EngineDeadError as exc:
        yield sse(engine_unavailable(str(exc)).body())
    except RequestFailedError as exc:
        yield sse(request_failed(str(exc)).body())
    yield SSE_DONE


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """Streams a generation's events; however the stream ends (finished, client gone before or during it,
    server shutdown), its requests are aborted, so no block stays held for a reader that is not there."""

    media_type = "text/event-stream"

    def __init__(self, ctx: ServingContext, generation: Generation, events: AsyncIterator[dict]):
        super().__init__(event_stream(events))
        self._close = lambda: abort(ctx, generation)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()
            await self.body_iterator.aclose()


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    disk = sum(o.num_disk_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        # kvserve's extension: where the cached tokens came from (the pool, or the disk tier read into it)
        "kvserve_cached_tokens_by_tier": {"pool": cached - disk, "disk": disk},
    }


def token_text(tokenizer: Any, token_id: int) -> str:
    # Without a tokenizer, vLLM's convention for naming a token by its id.
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


@dataclass
class ChoiceProgress:
    """How much of one choice has been streamed, so each chunk carries only what is new."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False

    def advance(self, choice: CompletionOutput,
                with_tokens: bool) -> tuple[str, list[int], list[dict[int, float]]] | None:
        """New text, token ids and logprobs of `choice`, or None when there is nothing worth a chunk."""
        if self.finished:
            return None
        text = choice.text[self.text_len:]
        token_ids = choice.token_ids[self.num_tokens:]
        if not (text or choice.finished or (with_tokens and token_ids)):
            return None
        logprobs = (choice.logprobs or [])[self.num_tokens:]
        self.text_len, self.num_tokens, self.finished = len(choice.text), len(choice.token_ids), choice.finished
        return text, token_ids, logprobs
