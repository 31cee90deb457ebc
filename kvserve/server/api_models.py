"""Request bodies of the OpenAI API as pydantic models, strict about types, and their parsing at the edge."""
from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import numpy as np
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError, bad_request

logger = logging.getLogger("kvserve")

# Arrays and objects one body may hold: prompts, messages and their parts need far fewer. Python builds each as an
# object the garbage collector then walks: 2 MiB of tiny prompts took seconds to parse, holding the GIL.
MAX_JSON_CONTAINERS = 10_000

# Tried left to right, each list stopping at its first bad item: a union collects every item's error for every
# alternative otherwise, and a few MB of floats in `prompt` took pydantic many seconds.
TokenIds = Annotated[list[StrictInt], Field(fail_fast=True)]
Prompt = Annotated[
    Union[StrictStr, Annotated[list[StrictStr], Field(fail_fast=True)], TokenIds,
          Annotated[list[TokenIds], Field(fail_fast=True)]],
    Field(union_mode="left_to_right"),
]


class _Strict(BaseModel):
    # Unknown fields are an error, not silently dropped: a typo like "max_token" must not be ignored quietly.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields both endpoints share; the vLLM-style extras are the ones the engine implements."""

    # OpenAI parameters the engine does not implement, with the value that means "not used".
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"logit_bias": {}}
    # OpenAI parameters that common clients send and that change nothing here: accepted, logged, ignored.
    IGNORED: ClassVar[frozenset[str]] = frozenset({"store", "metadata", "service_tier", "prompt_cache_key",
                                                   "safety_identifier"})

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # what torch's generators take
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # OpenAI's end-user tag: accepted, and used for nothing
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)  # "" would read as "no salt": refused

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_GenerationRequest):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_GenerationRequest.UNSUPPORTED, "best_of": 1, "suffix": ""}

    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension: each prompt token's logprob + top k

    def prompts(self) -> list[str | list[int]]:
        """The prompt forms the API allows, as a list of single prompts."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
        return list(p)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, nothing generated (what log-likelihood clients
        such as lm-evaluation-harness ask, as OpenAI's legacy completions and vLLM answer)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1; 0 is allowed only with echo (the prompt and its "
                              "logprobs, nothing generated)", "max_tokens")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        # The engine samples at least one token; for a prompt-only request it is dropped from the answer.
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, str]:
        """The plain {"role", "content"} a chat template expects; text parts are joined by newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_GenerationRequest.UNSUPPORTED, "tools": [], "tool_choice": "none", "functions": [],
        "function_call": "none", "response_format": {"type": "text"}, "audio": None, "modalities": ["text"],
        "prediction": None, "reasoning_effort": None, "web_search_options": None,
    }
    IGNORED: ClassVar[frozenset[str]] = _GenerationRequest.IGNORED | {"parallel_tool_calls"}  # no tools: no effect

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)

    def as_sent(self, error: APIError) -> APIError:
        """`error` naming the field the client sent: the engine's max_tokens is max_completion_tokens when that was
        given, and its logprobs is always top_logprobs here."""
        sent = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            sent["max_tokens"] = "max_completion_tokens"
        if error.param in sent:
            error.message = re.sub(rf"\b{error.param}\b", sent[error.param], error.message, count=1)
            error.param = sent[error.param]
        return error


RequestT = TypeVar("RequestT", bound=_GenerationRequest)


def parse_request(model_cls: type[RequestT], raw_body: bytes) -> RequestT:
    """Parse a JSON body into `model_cls`, turning every problem into a 400 that names the parameter."""
    _check_num_containers(raw_body)
    try:
        # Unlike json.loads: refuses lone surrogates (not text), NaN / Infinity, and nesting past 200 levels.
        body = pydantic_core.from_json(raw_body, allow_inf_nan=False)
    except ValueError as exc:
        hint = " (a \\uD800-\\uDFFF escape must be half of a surrogate pair)" if "hex escape" in str(exc) else ""
        raise bad_request(f"the request body is not valid JSON: {exc}{hint}") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    _drop_unused(model_cls, body)
    unknown = body.keys() - model_cls.model_fields.keys()
    if unknown:  # found here, not by pydantic: it would build an error for each of a million unknown keys
        name = next(key for key in body if key in unknown)
        raise bad_request(f"unknown parameter {name!r}", name, "unknown_parameter")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


def _check_num_containers(raw_body: bytes) -> None:
    num_brackets = raw_body.count(b"[") + raw_body.count(b"{")
    if num_brackets <= MAX_JSON_CONTAINERS:  # the usual case, in a millisecond for 2 MiB
        return
    if _num_brackets_outside_strings(raw_body) > MAX_JSON_CONTAINERS:  # brackets in a prompt's text are no containers
        raise bad_request(f"the request body has more than {MAX_JSON_CONTAINERS:,} JSON arrays and objects; kvserve "
                          f"takes at most that many in one request")


def _num_brackets_outside_strings(raw_body: bytes) -> int:
    """`[` and `{` outside JSON strings, in a few passes over the bytes with no Python object per string (a regex
    taking the strings out made one per match: 350,000 strings of one `[` held the GIL for the whole body)."""
    unescaped = raw_body.replace(b"\\\\", b"").replace(b'\\"', b"")  # left to right, as JSON reads escapes
    chars = np.frombuffer(unescaped, np.uint8)
    in_string = np.bitwise_xor.accumulate(chars == ord('"'))  # a closing quote reads as outside: it is no bracket
    return int(np.count_nonzero(((chars == ord("[")) | (chars == ord("{"))) & ~in_string))


def _drop_unused(model_cls: type[RequestT], body: dict[str, Any]) -> None:
    """Remove the OpenAI parameters kvserve ignores (with a warning) or refuses unless given their no-op value."""
    for name, no_op in model_cls.UNSUPPORTED.items():
        value = body.pop(name, None)
        if value is not None and not (type(value) is type(no_op) and value == no_op):  # best_of: true is not 1
            raise bad_request(f"{name!r} is not supported by kvserve (only its no-op value {json.dumps(no_op)} is "
                              f"accepted)", name, "unsupported_parameter")
    ignored = sorted(name for name in model_cls.IGNORED if body.pop(name, None) is not None)
    if ignored:
        logger.warning(f"ignoring request parameters kvserve does not use: {', '.join(ignored)}")


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def _validation_error(exc: ValidationError) -> APIError:
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"] if not _is_union_tag(part)]
    param = ".".join(loc) or None
    if error["type"] == "extra_forbidden":
        return bad_request(f"unknown parameter {param!r}", param, "unknown_parameter")
    if error["type"] == "missing":
        return bad_request(f"{param!r} is required", param)
    shown = json.dumps(error.get("input"), default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    # Inside a union pydantic reports the first alternative's complaint, which misleads; say what failed instead.
    reason = "wrong type or shape" if len(loc) < len(error["loc"]) else error["msg"]
    return bad_request(f"invalid {param!r}: {reason} (got {shown})", param)


def _is_union_tag(part: str | int) -> bool:
    """pydantic names the union alternative it tried ('str', 'list[int]', 'function-after[...]') in an error's loc."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
