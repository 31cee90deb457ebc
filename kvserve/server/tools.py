"""Tool calling in kvserve's default format, Hermes-style: the tools and how to call them are written into the
system turn, the model answers with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, which are
parsed into OpenAI `tool_calls`; "required" and a named function are constrained by a grammar (a Lark grammar
over the functions' JSON schemas) so every call parses and matches its function's parameters. Earlier tool calls
and tool results in the conversation are written back in the same format, so any chat template renders them."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.structured import JSON_OPTIONS
from kvserve.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
INSTRUCTIONS = (
    "You may call one or more functions to help with the user's request. The functions are given as JSON "
    "schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> "
    "tags, one block per call:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": index, **call} if index is not None else call


def system_prompt(functions: list[dict[str, Any]]) -> str:
    """The instructions the system turn gets for these functions ({"name", "description", "parameters"} each)."""
    return INSTRUCTIONS.format(tools="\n".join(json.dumps({"type": "function", "function": f}) for f in functions))


def with_tools(messages: list[dict[str, str]], functions: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation with the tool instructions at the start of its system turn (a new one if it has none)."""
    instructions = system_prompt(functions)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": instructions + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def call_text(name: str, arguments: str) -> str:
    """One earlier call as the model would have written it (an assistant message's tool_calls)."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call {name!r} has arguments that are not JSON: {exc}") from exc
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': parsed})}\n{CLOSE}"


def result_text(content: str) -> str:
    """A tool's result as the user turn that hands it back."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_grammar(functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
    """A Lark grammar (llguidance's dialect) for one call, or one or more with `parallel`, of these functions."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (f"start: call{repeat}\n"
            f"call: \"{OPEN}\\n\" body \"\\n{CLOSE}\"\n"
            f"body: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}\n")
    return StructuredOutputsParams(grammar=lark)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside tool-call blocks, and the calls whose blocks parse as {"name": str, "arguments": object}.
    A block that does not parse stays in the text."""
    calls, kept, end = [], [], 0
    for match in _CALL.finditer(text):
        call = _parsed(match.group(1))
        if call is None:
            continue
        kept.append(text[end:match.start()])
        calls.append(call)
        end = match.end()
    kept.append(text[end:])
    return "".join(kept).strip() if calls else text, calls


def _parsed(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class StreamParser:
    """Splits one choice's streamed text into content and tool calls as they complete: text that may open a
    `<tool_call>` block is held back until it does or cannot."""

    buffer: str = ""
    num_calls: int = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that is certainly not a call, and the calls completed by `text`."""
        self.buffer += text
        content, calls = [], []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_open(self.buffer)
                content.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            call = _parsed(self.buffer[start + len(OPEN):end].strip())
            block_end = end + len(CLOSE)
            if call is None:
                content.append(self.buffer[:block_end])
            else:
                content.append(self.buffer[:start])
                calls.append(call)
            self.buffer = self.buffer[block_end:]
        self.num_calls += len(calls)
        joined = "".join(content)
        return (joined.strip() if self.num_calls else joined), calls

    def flush(self) -> str:
        """What was held back, once the choice has finished (an unclosed block cut by max_tokens)."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
