"""Tool calling in kvserve's default format, Hermes-style: the tools and how to call them are written into the
system turn, the model answers with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, which are
parsed into tool calls; "required" and a named function are constrained by a grammar (a Lark grammar over the
functions' JSON schemas) so every call parses and matches its function's parameters. Earlier tool calls and tool
results in the conversation are written back in the same format, so any chat template renders them. The format is
model-independent and shared: the offline `LLM.chat(..., tools=...)` uses it through `ToolRequest`, the server
(kvserve/server/chat.py) writes the calls in OpenAI's HTTP shape."""
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

    def as_dict(self) -> dict[str, str]:
        """{"id", "name", "arguments"}: what the offline API's CompletionOutput.tool_calls holds."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


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


NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
TOOL_CHOICE = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


@dataclass(frozen=True)
class ToolRequest:
    """One chat request's tools in OpenAI's shapes, checked once: the functions ({"name", "description",
    "parameters"}), how they take part ("none", "auto", "required" or "named"), the named function, and whether a
    required answer may hold several calls. The offline `LLM.chat(..., tools=...)` builds one."""

    functions: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None
    parallel: bool = True

    @classmethod
    def from_openai(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True) -> ToolRequest:
        """`tools`, `tool_choice` and `parallel_tool_calls` as OpenAI's API takes them; a ValueError names what is
        wrong."""
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got "
                             f"{type(tools).__name__}")
        functions = tuple(_function(tool, index) for index, tool in enumerate(tools or []))
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ValueError("tools have two functions of the same name")
        if not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
        mode, name = _mode(tool_choice, names)
        return cls(functions, mode, name, parallel_tool_calls)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the chat template gets it: earlier calls and tool results as text, and the tool
        instructions in the system turn unless the mode is "none"."""
        turns = [_template_turn(message, index) for index, message in enumerate(messages)]
        return with_tools(turns, list(self.functions)) if self.mode != "none" else turns

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of "required" (any function) and "named" (that one) answers; None for "none" and "auto"."""
        if self.mode in ("none", "auto"):
            return None
        functions = [f for f in self.functions if self.mode == "required" or f["name"] == self.name]
        return call_grammar(functions, self.parallel and self.mode == "required")

    def calls(self, text: str) -> list[dict[str, str]] | None:
        """The calls parsed out of an answer as {"id", "name", "arguments"}; None when tools take no part."""
        return None if self.mode == "none" else [call.as_dict() for call in parse(text)[1]]


def _function(tool: Any, index: int) -> dict[str, Any]:
    """One tool's function as {"name", "description", "parameters"} (those given), checked."""
    where = f"tools[{index}]"
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
            and set(tool) == {"type", "function"}):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, "
                         f"got {tool!r}")
    function = tool["function"]
    unknown = sorted(set(function) - set(FUNCTION_KEYS))
    if unknown:
        raise ValueError(f"{where}.function has unknown keys {unknown}; it takes {', '.join(FUNCTION_KEYS)}")
    name = function.get("name")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise ValueError(f"{where}.function.description must be text")
    if not isinstance(function.get("parameters", {}), (dict, type(None))):
        raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    return {key: function[key] for key in FUNCTION_KEYS[:3] if function.get(key) is not None}


def _mode(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    """How tools take part, and the function a named choice names."""
    if not names:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return "none", None
    choice = "auto" if tool_choice is None else tool_choice  # OpenAI's default when tools are given
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"{TOOL_CHOICE}, got {choice!r}")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"{TOOL_CHOICE}, got {choice!r}")
    if name not in names:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return "named", name


def _template_turn(message: Any, index: int) -> dict[str, Any]:
    """One message as the chat template gets it: a tool's result as a user turn, an assistant's earlier calls as
    `<tool_call>` blocks after its text."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    if message.get("role") == "tool":
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{index}]: a tool message holds the tool's result as text in 'content'")
        return {"role": "user", "content": result_text(message["content"])}
    turn = {key: value for key, value in message.items() if key != "tool_calls"}
    calls = message.get("tool_calls")
    if not calls:
        return turn
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise ValueError(f"messages[{index}]: 'tool_calls' belongs to assistant messages, as a list")
    texts = [_earlier_call(call, index) for call in calls]
    content = message.get("content") or ""
    return {**turn, "content": "\n".join([content, *texts] if content else texts)}


def _earlier_call(call: Any, index: int) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)):
        raise ValueError(f"messages[{index}].tool_calls: each call is {{'id': ..., 'type': 'function', "
                         f"'function': {{'name': ..., 'arguments': JSON text}}}}, got {call!r}")
    try:
        return call_text(function["name"], function["arguments"])
    except ValueError as exc:
        raise ValueError(f"messages[{index}]: {exc}") from exc
