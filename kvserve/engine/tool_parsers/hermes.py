"""Hermes-style calls, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`: the Qwen family's templates
render tools this way, and it is kvserve's default for a model whose template renders none (the embedded SmolLM2):
kvserve then writes the tools and how to call them into the system turn, earlier calls as these blocks and tool
results as `<tool_response>` user turns, so any chat template carries them."""
from __future__ import annotations

import json
from typing import Any

from kvserve.engine.tool_parsers.base import (BlockStreamParser, ToolCall, ToolFormat, call_from, call_schemas,
                                              json_rule, split_blocks)
from kvserve.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
INSTRUCTIONS = (
    "You may call one or more functions to help with the user's request. The functions are given as JSON "
    "schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> "
    "tags, one block per call:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


class Hermes(ToolFormat):
    name = "hermes"
    writes_instructions = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return split_blocks(text, OPEN, CLOSE, parse_block)

    def stream_parser(self) -> BlockStreamParser:
        return BlockStreamParser(OPEN, CLOSE, parse_block)

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        repeat = ' ("\\n" call)*' if parallel else ""
        return StructuredOutputsParams(grammar=f"start: call{repeat}\n"
                                               f"call: \"{OPEN}\\n\" body \"\\n{CLOSE}\"\n"
                                               f"body: {json_rule(call_schemas(functions, 'arguments'))}\n")


def parse_block(body: str) -> list[ToolCall] | None:
    try:
        call = call_from(json.loads(body), "arguments")
    except json.JSONDecodeError:
        return None
    return None if call is None else [call]


def system_prompt(functions: list[dict[str, Any]]) -> str:
    """The instructions the system turn gets for these functions ({"name", "description", "parameters"} each)."""
    return INSTRUCTIONS.format(tools="\n".join(json.dumps({"type": "function", "function": f}) for f in functions))


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
