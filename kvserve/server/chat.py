"""POST /v1/chat/completions: the messages go through the model's chat template into one engine request."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.engine import chat_prompt
from kvserve.engine.chat_prompt import ChatTemplateError, needs_segments, rendered_segments, segment_token_ids
from kvserve.engine.tool_parsers import StreamParser, ToolCall
from kvserve.engine.tools import ToolRequest
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import is_text
from kvserve.server.api_models import ChatCompletionRequest
from kvserve.server.async_engine import updates
from kvserve.server.errors import APIError, bad_request, bad_value
from kvserve.server.generation import (CLIENT_CLOSED_REQUEST, ChoiceProgress, EventStreamResponse, Generation,
                                       ServingContext, compile_constraint, final_outputs, header, new_id, start,
                                       token_text, usage)

FIELDS = set(ChatCompletionRequest.model_fields)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    req.check_stream_options()
    if ctx.tokenizer is None or not getattr(ctx.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions with a plain prompt", "messages")
    tool_request = req.tool_request(ctx.tool_format)
    if tool_request.mode == "auto" and not ctx.auto_tool_choice:
        raise bad_request('tool_choice "auto" (the default with tools) needs a server started with '
                          '--enable-auto-tool-choice; send tool_choice "required", a named function or "none"',
                          "tool_choice")
    try:
        messages = req.messages_for_template(tool_request)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    try:
        params = req.sampling_params(tool_request)
        # The rendered prompt holds every message, so this bounds it before the template runs.
        ctx.engine.engine.check_prompt_chars(sum(len(m["content"]) for m in messages))
    except ValueError as exc:
        raise req.as_sent(bad_value(exc, FIELDS, "messages")) from exc
    await compile_constraint(ctx, params, _constraint_param(req))
    prompt = await ctx.engine.run_in_tokenizer_thread(chat_token_ids, ctx, messages, tool_request.template_tools())
    try:
        generation = await start(ctx, new_id("chatcmpl"), [prompt], req.cache_salt, params, FIELDS, "messages")
    except APIError as error:
        req.as_sent(error)
        raise
    if req.stream:
        return EventStreamResponse(ctx, generation, _chunks(ctx, req, tool_request, generation))
    outputs = await final_outputs(ctx, generation, request)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = [_choice(ctx, req, tool_request, c) for c in outputs[0].outputs]
    return JSONResponse({**header(ctx, generation, "chat.completion"), "choices": choices, "usage": usage(outputs)})


def _constraint_param(req: ChatCompletionRequest) -> str:
    """The field a constraint that does not compile came from."""
    if req.tool_mode in ("required", "named"):
        return "tools"
    return "response_format" if req.response_format is not None else "structured_outputs"


def _choice(ctx: ServingContext, req: ChatCompletionRequest, tool_request: ToolRequest,
            c: CompletionOutput) -> dict[str, Any]:
    """One choice of a whole answer; with tools, the tool calls parsed out of its text."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish_reason = c.finish_reason
    if tool_request.mode != "none":
        content, calls = tool_request.parse(c.text)
        if calls:
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": [_openai_call(call) for call in calls]}
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"index": c.index, "message": message, "logprobs": _logprobs(ctx, req, c.token_ids, c.logprobs),
            "finish_reason": finish_reason, "stop_reason": c.stop_reason}


def chat_token_ids(ctx: ServingContext, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    """The rendered conversation's token ids (`tools` for a template that renders them); the template holds its own
    special tokens (BOS), so none are added.
    Message content is text, as OpenAI treats it (kvserve/engine/chat_prompt.py), unless the server was started
    with --chat-content-special-tokens."""
    engine = ctx.engine.engine
    if ctx.content_special_tokens or not needs_segments(ctx.tokenizer, messages):
        return engine.encode(render_chat(ctx, messages, tools), add_special_tokens=False)
    try:
        segments = rendered_segments(ctx.tokenizer, messages, tools)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    engine.check_prompt_chars(sum(len(text) for text, _ in segments))
    if not all(is_text(text) for text, _ in segments):
        raise ValueError("the messages are not valid Unicode text (they have a lone surrogate)")
    return segment_token_ids(ctx.tokenizer, segments)


def render_chat(ctx: ServingContext, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
    """The prompt text: the conversation through the model's chat template, ending where the assistant speaks."""
    try:
        return chat_prompt.render_chat(ctx.tokenizer, messages, tools)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, token_ids: list[int],
              logprobs: list[dict[int, float]] | None) -> dict[str, list] | None:
    """The chat logprobs object: each token with its logprob and the `top_logprobs` most likely alternatives."""
    if not req.logprobs:
        return None
    k = req.top_logprobs or 0
    content = []
    for token_id, top in zip(token_ids, logprobs or []):
        best = sorted(top.items(), key=lambda item: -item[1])[:k]
        content.append({**_entry(ctx, token_id, top[token_id]),
                        "top_logprobs": [_entry(ctx, t, logprob) for t, logprob in best]})
    return {"content": content}


def _entry(ctx: ServingContext, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(ctx.tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


async def _chunks(ctx: ServingContext, req: ChatCompletionRequest, tool_request: ToolRequest,
                  generation: Generation) -> AsyncIterator[dict[str, Any]]:
    head = header(ctx, generation, "chat.completion.chunk")
    extra = {"usage": None} if req.include_usage else {}
    # Like OpenAI, every choice opens with the assistant role before any content.
    for index in range(req.n):
        yield {**head, "choices": [_delta(index, {"role": "assistant", "content": ""}, None, None)], **extra}
    progress = [ChoiceProgress() for _ in range(req.n)]
    parsers = [tool_request.format.stream_parser() if tool_request.mode != "none" else None for _ in range(req.n)]
    last: RequestOutput | None = None
    async for batch in updates(generation.outputs, generation.request_ids):
        for last in batch:
            for c in last.outputs:
                new = progress[c.index].advance(c, req.logprobs)
                if new is not None:
                    text, token_ids, top_logprobs = new
                    logprobs = _logprobs(ctx, req, token_ids, top_logprobs)
                    if parsers[c.index] is None:
                        yield {**head, "choices": [_delta(c.index, {"content": text}, logprobs, c)], **extra}
                        continue
                    text = tool_request.format.trim(text) if c.finished else text
                    for choice in _tool_deltas(parsers[c.index], c, text, logprobs):
                        yield {**head, "choices": [choice], **extra}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage([last])}


def _tool_deltas(parser: StreamParser, c: CompletionOutput, text: str,
                 logprobs: dict | None) -> list[dict[str, Any]]:
    """The chunks of one streamed update of a choice with tools: its content, each tool call completed by it (one
    delta per call, as OpenAI's clients assemble them), and the finish reason, "tool_calls" after a call."""
    content, calls = parser.feed(text)
    if c.finished:
        rest, last_calls = parser.flush()
        content, calls = content + rest, calls + last_calls
    deltas = [_delta(c.index, {"content": content}, logprobs, None)] if content or logprobs else []
    first = parser.num_calls - len(calls)
    deltas += [_delta(c.index, {"tool_calls": [_openai_call(call, first + i)]}, None, None)
               for i, call in enumerate(calls)]
    if c.finished:
        finish_reason = "tool_calls" if parser.num_calls and c.finish_reason == "stop" else c.finish_reason
        deltas.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                       "stop_reason": c.stop_reason})
    return deltas


def _openai_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A parsed call in OpenAI's shape; a streamed delta also carries the call's index in its choice."""
    shaped = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": index, **shaped} if index is not None else shaped


def _delta(index: int, delta: dict[str, str], logprobs: dict | None, c: CompletionOutput | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": c.finish_reason if c else None, "stop_reason": c.stop_reason if c else None}
