"""What every tool-call format shares: a parsed call, the format's interface, and a streaming parser for formats
whose calls sit in delimited blocks."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from kvserve.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, str]:
        """{"id", "name", "arguments"}: what the offline API's CompletionOutput.tool_calls holds."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


def call_from(value: Any, arguments_key: str) -> ToolCall | None:
    """A call from a decoded {"name": str, <arguments_key>: object}, or None when it is not one."""
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body (llguidance's dialect) matching JSON valid against `schema`, written compactly."""
    from kvserve.engine.structured import JSON_OPTIONS  # loads llguidance; `kvserve serve --help` needs none of it
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def call_schemas(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of {"name": one of the functions, <arguments_key>: its parameters}."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
              "properties": {"name": {"const": f["name"]},
                             arguments_key: f.get("parameters") or {"type": "object"}}} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class ToolFormat:
    """One model family's way of writing tool calls: how its answers are parsed into calls (whole and streamed),
    the grammar of a "required" or named answer, and how earlier calls go back to its chat template. `native`: the
    model's chat template renders the tools itself (else kvserve writes them into the system turn, which only a
    format with `writes_instructions` can)."""

    name: ClassVar[str]
    writes_instructions: ClassVar[bool] = False
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens the answer's text must keep
    arguments_as_text: ClassVar[bool] = False  # the template takes an earlier call's arguments as JSON text

    def __init__(self, native: bool, end_texts: tuple[str, ...] = ()):
        if not native and not self.writes_instructions:
            raise ValueError(f"--tool-call-parser {self.name} needs a chat template that renders tools, and this "
                             f"model's does not; use --tool-call-parser hermes (kvserve's default format)")
        self.native, self.end_texts = native, end_texts

    def trim(self, text: str) -> str:
        """A finished answer without the end-of-sequence token's text, which it keeps where the format keeps
        special tokens."""
        for end in self.end_texts if self.keeps_special_tokens else ():
            if end and text.endswith(end):
                return text[:-len(end)]
        return text

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text outside calls, and the calls that parse; a call that does not parse stays in the text."""
        raise NotImplementedError

    def stream_parser(self) -> StreamParser:
        raise NotImplementedError

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        """A Lark grammar for one call (or one or more with `parallel`) of these functions."""
        raise NotImplementedError

    def template_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """An earlier OpenAI call ({"id", "type", "function": {"name", "arguments": JSON text}}) as chat templates
        take it: arguments as an object unless the format's template prints them as text."""
        function = call["function"]
        arguments = function["arguments"] if self.arguments_as_text else json.loads(function["arguments"])
        return {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}


class StreamParser:
    """One choice's streamed text split into content and calls as they complete."""

    num_calls: int = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that is certainly not part of a call, and the calls completed by `text`."""
        raise NotImplementedError

    def flush(self) -> tuple[str, list[ToolCall]]:
        """What was held back, once the choice has finished: the calls it completes, the rest as content."""
        raise NotImplementedError


class BlockStreamParser(StreamParser):
    """For formats whose calls sit between an opening and a closing marker: text that may begin the opening marker
    is held back until it does or cannot, and a block goes out as calls when it closes (as text if it does not
    parse)."""

    def __init__(self, open_: str, close: str, parse_block: Callable[[str], list[ToolCall] | None]):
        self.open, self.close, self.parse_block = open_, close, parse_block
        self.buffer, self.num_calls = "", 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = [], []
        while True:
            start = self.buffer.find(self.open)
            if start < 0:
                keep = partial_suffix(self.buffer, self.open)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(self.close, start + len(self.open))
            if end < 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            block_end = end + len(self.close)
            parsed = self.parse_block(self.buffer[start + len(self.open):end])
            content.append(self.buffer[:block_end] if parsed is None else self.buffer[:start])
            calls += parsed or []
            self.buffer = self.buffer[block_end:]
        self.num_calls += len(calls)
        joined = "".join(content)
        return (joined.strip() if self.num_calls else joined), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        return rest, []


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_blocks(text: str, open_: str, close: str,
                 parse_block: Callable[[str], list[ToolCall] | None]) -> tuple[str, list[ToolCall]]:
    """Whole-text parsing of a block format: the text outside blocks that parse, and their calls."""
    parser = BlockStreamParser(open_, close, parse_block)
    content, calls = parser.feed(text)
    rest, _ = parser.flush()
    if not calls:
        return text, []
    return (content + rest).strip(), calls
