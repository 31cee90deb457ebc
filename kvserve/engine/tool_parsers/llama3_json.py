"""Llama 3.x JSON calls, as the Llama 3.1-3.3 templates ask for them: the whole answer is
`{"name": ..., "parameters": {...}}` (several joined by "; "), possibly after `<|python_tag|>` (a special token,
skipped like the others unless the request keeps them). An answer that does not start that way, or does not
parse all through, is content."""
from __future__ import annotations

import json
from typing import Any

from kvserve.engine.tool_parsers.base import (StreamParser, ToolCall, ToolFormat, call_from, call_schemas, json_rule,
                                              partial_suffix)
from kvserve.sampling_params import StructuredOutputsParams

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "


class Llama3Json(ToolFormat):
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = parse_calls(text)
        return ("", calls) if calls else (text, [])

    def stream_parser(self) -> StreamParser:
        return WholeAnswerParser()

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        repeat = f' ("{SEPARATOR}" call)*' if parallel else ""
        return StructuredOutputsParams(grammar=f"start: call{repeat}\n"
                                               f"call: {json_rule(call_schemas(functions, 'parameters'))}\n")


def parse_calls(text: str) -> list[ToolCall]:
    """The calls the answer consists of, or [] when it is not only calls."""
    rest = text.strip().removeprefix(PYTHON_TAG).lstrip()
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return []
        arguments_key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        call = call_from(value, arguments_key)
        if call is None:
            return []
        calls.append(call)
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return calls


class WholeAnswerParser(StreamParser):
    """An answer that opens like a call is held until it finishes (it is calls only if it parses all through);
    any other answer streams as content."""

    def __init__(self):
        self.buffer, self.holding, self.num_calls = "", None, 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.holding is False:
            return text, []
        self.buffer += text
        start = self.buffer.lstrip()
        if not start or partial_suffix(start, PYTHON_TAG + "{") == len(start):
            return "", []  # could still open a call
        self.holding = start.startswith(("{", PYTHON_TAG))
        if self.holding:
            return "", []
        content, self.buffer = self.buffer, ""
        return content, []

    def flush(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        calls = parse_calls(rest) if self.holding is not False else []
        self.num_calls += len(calls)
        return ("", calls) if calls else (rest, [])
