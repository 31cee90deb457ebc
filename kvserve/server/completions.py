"""POST /v1/completions: one engine request per prompt, `n` choices each (choice i*n+j is sample j of prompt i)."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.api_models import CompletionRequest
from kvserve.server.async_engine import updates
from kvserve.server.errors import bad_value
from kvserve.server.generation import (CLIENT_CLOSED_REQUEST, ChoiceProgress, EventStreamResponse, Generation,
                                       ServingContext, compile_constraint, final_outputs, header, new_id, start,
                                       token_text, usage)

FIELDS = set(CompletionRequest.model_fields)


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request) -> Response:
    ctx.check_model(req.model)
    req.check_stream_options()
    prompts = req.prompts()
    try:
        params = req.sampling_params()
    except ValueError as exc:
        raise bad_value(exc, FIELDS) from exc
    await compile_constraint(ctx, params, "response_format" if req.response_format is not None
                             else "structured_outputs")
    generation = await start(ctx, new_id("cmpl"), prompts, req.cache_salt, params, FIELDS, "prompt")
    echoes = [_prompt_text(ctx, p) if req.echo else "" for p in prompts]
    if req.stream:
        return EventStreamResponse(ctx, generation, _chunks(ctx, req, generation, echoes))
    outputs = await final_outputs(ctx, generation, request)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if req.prompt_only:
        outputs = [_without_generation(output) for output in outputs]
    choices = []
    for i, output in enumerate(outputs):
        for c in output.outputs:
            logprobs = None
            if req.logprobs is not None:
                logprobs = _logprobs(ctx, c.token_ids, c.logprobs or [], len(echoes[i]))
                if req.echo:
                    logprobs = _join(_echoed_logprobs(ctx, output), logprobs)
            choice = _choice(req.n * i + c.index, echoes[i] + c.text, logprobs, c)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(ctx, output)
            choices.append(choice)
    return JSONResponse({**header(ctx, generation, "text_completion"), "choices": choices, "usage": usage(outputs)})


def _without_generation(output: RequestOutput) -> RequestOutput:
    """The output of a prompt-only request (echo, max_tokens 0): the token the engine sampled is dropped, and a
    choice that ended normally ended by its length."""
    choices = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                   cumulative_logprob=None, stop_reason=None,
                                   finish_reason=c.finish_reason if c.finish_reason in (None, "error", "abort")
                                   else "length")
               for c in output.outputs]
    return dataclasses.replace(output, outputs=choices)


def _prompt_text(ctx: ServingContext, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return ctx.tokenizer.decode(prompt) if ctx.tokenizer is not None else ""


def _choice(index: int, text: str, logprobs: dict | None, c: CompletionOutput) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def _prompt_logprobs(ctx: ServingContext, output: RequestOutput) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id: {logprob, decoded_token}} for the
    top k alternatives and the token itself."""
    return [None if entry is None else {
        str(t): {"logprob": lp, "decoded_token": token_text(ctx.tokenizer, t)} for t, lp in entry.items()
    } for entry in output.prompt_logprobs or []]


def _echoed_logprobs(ctx: ServingContext, output: RequestOutput) -> dict[str, list]:
    """The legacy logprobs object for an echoed prompt: its first token has nothing to be predicted from."""
    token_ids, entries = output.prompt_token_ids, (output.prompt_logprobs or [None])[1:]
    scored = _logprobs(ctx, token_ids[1:], entries, len(token_text(ctx.tokenizer, token_ids[0])))
    return {"tokens": [token_text(ctx.tokenizer, token_ids[0]), *scored["tokens"]],
            "token_logprobs": [None, *scored["token_logprobs"]], "top_logprobs": [None, *scored["top_logprobs"]],
            "text_offset": [0, *scored["text_offset"]]}


def _join(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    """Two logprobs objects, the second's text offsets moved past the first's tokens."""
    shift = sum(len(token) for token in first["tokens"]) - (second["text_offset"][0] if second["text_offset"] else 0)
    return {**{key: first[key] + second[key] for key in ("tokens", "token_logprobs", "top_logprobs")},
            "text_offset": first["text_offset"] + [offset + shift for offset in second["text_offset"]]}


def _logprobs(ctx: ServingContext, token_ids: list[int], logprobs: list[dict[int, float]],
              text_offset: int) -> dict[str, list]:
    """The legacy completions logprobs object, for the given tokens; offsets count from `text_offset`."""
    tokens = [token_text(ctx.tokenizer, t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [top[t] for t, top in zip(token_ids, logprobs)],
        "top_logprobs": [{token_text(ctx.tokenizer, t): lp for t, lp in top.items()} for top in logprobs],
        "text_offset": offsets,
    }


async def _chunks(ctx: ServingContext, req: CompletionRequest, generation: Generation,
                  echoes: list[str]) -> AsyncIterator[dict[str, Any]]:
    head = header(ctx, generation, "text_completion")
    extra = {"usage": None} if req.include_usage else {}
    prompt_index = {request_id: i for i, request_id in enumerate(generation.request_ids)}
    progress: dict[int, ChoiceProgress] = {}  # by choice index
    offsets: dict[int, int] = {}  # where the choice's next token starts in its text, echoed prompt included
    last: dict[str, RequestOutput] = {}
    async for batch in updates(generation.outputs, generation.request_ids):
        for output in batch:
            output = _without_generation(output) if req.prompt_only else output
            last[output.request_id] = output
            i = prompt_index[output.request_id]
            for c in output.outputs:
                index = req.n * i + c.index
                new = progress.setdefault(index, ChoiceProgress()).advance(c, req.logprobs is not None)
                if new is None:
                    continue
                text, token_ids, top_logprobs = new
                echo = echoes[i] if index not in offsets else ""  # the prompt goes out with a choice's first chunk
                offset = offsets.get(index, len(echoes[i]))
                first = index not in offsets
                logprobs = None
                if req.logprobs is not None:
                    logprobs = _logprobs(ctx, token_ids, top_logprobs, offset)
                    offset += sum(len(token) for token in logprobs["tokens"])
                    if req.echo and first:
                        logprobs = _join(_echoed_logprobs(ctx, output), logprobs)
                offsets[index] = offset
                choice = _choice(index, echo + text, logprobs, c)
                if req.prompt_logprobs is not None and first:
                    choice["prompt_logprobs"] = _prompt_logprobs(ctx, output)
                yield {**head, "choices": [choice], **extra}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage([last[r] for r in generation.request_ids])}
