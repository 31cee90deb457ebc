"""Request bodies of the OpenAI API as pydantic models, strict about types, and their parsing at the edge."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import numpy as np
import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from kvserve.engine.tool_parsers import ToolFormat
from kvserve.engine.tool_parsers.hermes import Hermes
from kvserve.engine.tools import ToolRequest
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
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


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always matches the schema: the same with true or false


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise bad_request(f"response_format.json_schema is only allowed with type 'json_schema', not "
                                  f"{self.type!r}", "response_format.json_schema")
            return StructuredOutputsParams(json_object=True) if self.type == "json_object" else None
        if self.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs a 'json_schema' object",
                              "response_format.json_schema")
        return StructuredOutputsParams(json=self.json_schema.schema_ or {})  # OpenAI: no schema means any JSON


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
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: {"json" | "regex" | "choice" | ...: ...}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def constraint(self) -> StructuredOutputsParams | None:
        """What response_format or structured_outputs asks the output to match (at most one of them)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        if self.response_format is not None:
            return self.response_format.structured_outputs()
        if self.structured_outputs is None:
            return None
        try:
            return StructuredOutputsParams(**self.structured_outputs)
        except TypeError as exc:
            raise bad_request(f"structured_outputs takes json, json_object, regex, choice or grammar ({exc})",
                              "structured_outputs") from exc

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                         structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs,
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
        constraint = None if self.prompt_only else self.constraint()
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, constraint)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # "required" and named calls always match the parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The message as a dict in OpenAI's shape, text parts joined by newlines; kvserve/engine/tools.py writes
        earlier tool calls and tool results the way the model's tool format takes them."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def check(self, index: int) -> None:
        """Refuse fields that do not belong to this message's role, naming the field."""
        param = f"messages.{index}"
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a message with role 'tool' needs 'tool_call_id'", f"{param}.tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise bad_request("'tool_call_id' belongs to messages with role 'tool'", f"{param}.tool_call_id")
        if self.role != "assistant" and self.tool_calls is not None:
            raise bad_request("'tool_calls' belongs to messages with role 'assistant'", f"{param}.tool_calls")


class ChatCompletionRequest(_GenerationRequest):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_GenerationRequest.UNSUPPORTED, "functions": [], "function_call": "none", "audio": None,
        "modalities": ["text"], "prediction": None, "reasoning_effort": None, "web_search_options": None,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self, tool_request: ToolRequest | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        tool_request = tool_request or self.tool_request()
        params = self._sampling_params(max_tokens, logprobs, structured_outputs=self._constraint(tool_request))
        if tool_request.mode != "none" and tool_request.format.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the format's markers are special
        return params

    @property
    def tool_mode(self) -> str:
        """How tools take part: "none" (not rendered, output not parsed), "auto", "required" or "named"."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise bad_request("tool_choice needs 'tools'", "tool_choice")
            return "none"
        choice = self.tool_choice or "auto"  # OpenAI's default when tools are given
        return choice if isinstance(choice, str) else "named"

    def tool_request(self, tool_format: ToolFormat | None = None) -> ToolRequest:
        """The request's tools checked (unique names, a named function that is among them) in `tool_format`
        (kvserve's default when None)."""
        mode = self.tool_mode
        functions = [f.function.model_dump(exclude_none=True, exclude={"strict"}) for f in self.tools or []]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise bad_request("tools have two functions of the same name", "tools")
        name = self.tool_choice.function.name if mode == "named" else None
        if mode == "named" and name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                              "tool_choice.function.name")
        return ToolRequest(tuple(functions), mode, name, self.parallel_tool_calls,
                           tool_format or Hermes(native=False))

    def messages_for_template(self, tool_request: ToolRequest) -> list[dict[str, Any]]:
        """The messages as the chat template gets them, tool turns written in the request's tool format (a
        ValueError names a message whose tool call is not JSON)."""
        for index, message in enumerate(self.messages):
            message.check(index)
        return tool_request.messages([m.to_template() for m in self.messages])

    def _constraint(self, tool_request: ToolRequest) -> StructuredOutputsParams | None:
        mode = tool_request.mode
        if mode in ("none", "auto"):
            if mode == "auto" and self.constraint() is not None:
                raise bad_request("response_format (or structured_outputs) with tools needs tool_choice 'none'",
                                  "response_format")
            return self.constraint()
        if self.constraint() is not None:
            raise bad_request(f"response_format (or structured_outputs) cannot be combined with tool_choice "
                              f"{mode!r}", "response_format")
        return tool_request.constraint()

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
