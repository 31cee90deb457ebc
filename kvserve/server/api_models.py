"""Request bodies of the OpenAI API as pydantic models, strict about types, and their parsing at the edge."""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError, bad_request

Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class _Strict(BaseModel):
    # Unknown fields are an error, not silently dropped: a typo like "max_token" must not be ignored quietly.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields both endpoints share; the vLLM-style extras are the ones the engine implements."""

    # OpenAI parameters the engine does not implement, with the value that means "not used".
    UNSUPPORTED: ClassVar[dict[str, Any]] = {"logit_bias": {}}

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
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_GenerationRequest):
    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_GenerationRequest.UNSUPPORTED, "best_of": 1, "suffix": ""}

    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt forms the API allows, as a list of single prompts."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise bad_request("prompt is empty; give a string, a list of strings or token ids", "prompt")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            raise bad_request("echo together with logprobs needs prompt logprobs, which kvserve does not compute",
                              "echo")
        return self._sampling_params(self.max_tokens, self.logprobs)


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
        "function_call": "none", "response_format": {"type": "text"}, "parallel_tool_calls": None,
        "audio": None, "modalities": ["text"], "prediction": None, "reasoning_effort": None,
        "web_search_options": None,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)


RequestT = TypeVar("RequestT", bound=_GenerationRequest)


def parse_request(model_cls: type[RequestT], raw_body: bytes) -> RequestT:
    """Parse a JSON body into `model_cls`, turning every problem into a 400 that names the parameter."""
    try:
        body = json.loads(raw_body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, unused_value in model_cls.UNSUPPORTED.items():
        value = body.pop(name, None)
        if value is not None and value != unused_value:
            raise bad_request(f"{name!r} is not supported by kvserve", name, "unsupported_parameter")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


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
