"""One chat request's tools, in OpenAI's shapes, through a tool-call format (kvserve/engine/tool_parsers/): the
conversation as the chat template gets it (the template renders the tools and earlier calls itself when it can,
else kvserve's default format writes them as text), the grammar of a "required" or named answer, and the calls
parsed out of an answer. The offline `LLM.chat(..., tools=...)` and the server (kvserve/server/chat.py) share it."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.tool_parsers import ToolCall, ToolFormat, hermes
from kvserve.engine.tool_parsers.hermes import Hermes
from kvserve.sampling_params import StructuredOutputsParams

__all__ = ["ToolCall", "ToolRequest", "with_tools"]


def with_tools(messages: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with kvserve's tool instructions at the start of its system turn (a new one if none)."""
    instructions = hermes.system_prompt(functions)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": instructions + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
TOOL_CHOICE = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


@dataclass(frozen=True)
class ToolRequest:
    """One chat request's tools in OpenAI's shapes, checked once: the functions ({"name", "description",
    "parameters"}), how they take part ("none", "auto", "required" or "named"), the named function, whether a
    required answer may hold several calls, and the tool-call format they are written and parsed in."""

    functions: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None
    parallel: bool = True
    format: ToolFormat = field(default_factory=lambda: Hermes(native=False))

    @classmethod
    def from_openai(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True,
                    tool_format: ToolFormat | None = None) -> ToolRequest:
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
        return cls(functions, mode, name, parallel_tool_calls, tool_format or Hermes(native=False))

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the chat template gets it. A template that renders tools gets earlier calls and tool
        results in HF's shapes (and the tools through `template_tools`); any other gets them as kvserve's text, and
        the tool instructions in its system turn unless the mode is "none"."""
        if self.format.native:
            return [_native_turn(message, index, self.format) for index, message in enumerate(messages)]
        turns = [_template_turn(message, index) for index, message in enumerate(messages)]
        return with_tools(turns, list(self.functions)) if self.mode != "none" else turns

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` a chat template that renders them gets; None when it does not, or the mode is "none"."""
        if not self.format.native or self.mode == "none":
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of "required" (any function) and "named" (that one) answers; None for "none" and "auto"."""
        if self.mode in ("none", "auto"):
            return None
        functions = [f for f in self.functions if self.mode == "required" or f["name"] == self.name]
        return self.format.grammar(functions, self.parallel and self.mode == "required")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """An answer's text outside its calls, and the calls (none when tools take no part)."""
        return (text, []) if self.mode == "none" else self.format.parse(self.format.trim(text))

    def calls(self, text: str) -> list[dict[str, str]] | None:
        """The calls parsed out of an answer as {"id", "name", "arguments"}; None when tools take no part."""
        return None if self.mode == "none" else [call.as_dict() for call in self.parse(text)[1]]


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
        return {"role": "user", "content": hermes.result_text(message["content"])}
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
        return hermes.call_text(function["name"], function["arguments"])
    except ValueError as exc:
        raise ValueError(f"messages[{index}]: {exc}") from exc


def _native_turn(message: Any, index: int, tool_format: ToolFormat) -> dict[str, Any]:
    """One message in HF's shapes for a chat template that renders tools: a tool's result stays a "tool" turn, an
    assistant's earlier calls stay `tool_calls` (arguments as the format's template takes them)."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}")
    if message.get("role") == "tool" and not isinstance(message.get("content"), str):
        raise ValueError(f"messages[{index}]: a tool message holds the tool's result as text in 'content'")
    calls = message.get("tool_calls")
    if not calls:
        return {**message, "content": message.get("content") or ""}
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise ValueError(f"messages[{index}]: 'tool_calls' belongs to assistant messages, as a list")
    for call in calls:
        _earlier_call(call, index)  # checks the shape and that the arguments are JSON
    return {**message, "content": message.get("content") or "",
            "tool_calls": [tool_format.template_call(call) for call in calls]}
