"""DeepSeek-V3 calls, as its chat template writes them: one `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`
block holding, per call, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments in a ```json fence,
closed by `<｜tool▁call▁end｜>`. The markers are special tokens of DeepSeek's tokenizer, so answers keep them."""
from __future__ import annotations

import json
import re
from typing import Any

from kvserve.engine.tool_parsers.base import BlockStreamParser, ToolCall, ToolFormat, json_rule, split_blocks
from kvserve.sampling_params import StructuredOutputsParams

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"function" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n"
                   r"(?P<arguments>.*?)\n```" + re.escape(CALL_END), re.DOTALL)


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    keeps_special_tokens = True
    arguments_as_text = True  # its template prints an earlier call's arguments as given

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return split_blocks(text, CALLS_BEGIN, CALLS_END, parse_block)

    def stream_parser(self) -> BlockStreamParser:
        return BlockStreamParser(CALLS_BEGIN, CALLS_END, parse_block)

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> StructuredOutputsParams:
        repeat = ' ("\\n" call)*' if parallel else ""
        alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
        rules = [f"start: {_quoted(CALLS_BEGIN)} call{repeat} {_quoted(CALLS_END)}",
                 f"call: {_quoted(CALL_BEGIN + 'function' + SEP)} ({alternatives})"]
        rules += [f"fn{i}: {_quoted(f['name'] + chr(10) + '```json' + chr(10))} "
                  f"{json_rule(f.get('parameters') or {'type': 'object'})} {_quoted(chr(10) + '```' + CALL_END)}"
                  for i, f in enumerate(functions)]
        return StructuredOutputsParams(grammar="\n".join(rules) + "\n")


def parse_block(body: str) -> list[ToolCall] | None:
    """The calls of one block, or None unless the whole block is calls that parse."""
    calls, end = [], 0
    for match in _CALL.finditer(body):
        if body[end:match.start()].strip():
            return None
        try:
            arguments = json.loads(match.group("arguments"))
        except json.JSONDecodeError:
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(match.group("name").strip(), json.dumps(arguments, ensure_ascii=False)))
        end = match.end()
    return calls if calls and not body[end:].strip() else None


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
