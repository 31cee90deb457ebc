"""Tool-call formats, one class per format, chosen once per server or LLM by name as vLLM's
`--tool-call-parser` does, or ("auto") from the model's chat template: a template that renders `tools` is read for
its call syntax; one that renders none (the embedded SmolLM2's) gets kvserve's default, Hermes-style, written into
the system turn."""
from __future__ import annotations

import re

import jinja2
import jinja2.meta

from kvserve.engine.tool_parsers.base import StreamParser, ToolCall, ToolFormat
from kvserve.engine.tool_parsers.deepseek_v3 import DeepSeekV3
from kvserve.engine.tool_parsers.hermes import Hermes
from kvserve.engine.tool_parsers.llama3_json import Llama3Json

FORMATS: dict[str, type[ToolFormat]] = {cls.name: cls for cls in (Hermes, Llama3Json, DeepSeekV3)}
PARSER_NAMES = ("auto", *FORMATS)
# What marks each format in a chat template that renders tools, checked in this order.
_TEMPLATE_MARKERS = (("deepseek_v3", ("tool▁calls▁begin",)), ("hermes", ("<tool_call>",)),
                     ("llama3_json", ('"parameters"', "<|python_tag|>", "ipython")))

__all__ = ["FORMATS", "PARSER_NAMES", "StreamParser", "ToolCall", "ToolFormat", "choose", "for_tokenizer",
           "renders_tools"]


def for_tokenizer(parser: str, tokenizer, eos_token_ids: frozenset[int] = frozenset()) -> ToolFormat:
    """`choose` for a model's tokenizer: its chat template, and its end-of-sequence tokens' text (which an answer
    decoded with its special tokens ends with)."""
    if tokenizer is None:
        return choose(parser, None)
    ends = tuple(tokenizer.decode([token_id], skip_special_tokens=False) for token_id in sorted(eos_token_ids))
    return choose(parser, getattr(tokenizer, "chat_template", None), ends)


def choose(parser: str, chat_template: str | None, end_texts: tuple[str, ...] = ()) -> ToolFormat:
    """The format named `parser` ("auto": the one the chat template writes, else kvserve's default), knowing
    whether the template renders the tools itself; a ValueError names the fix."""
    if parser != "auto" and parser not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_NAMES)}, got {parser!r}")
    native = renders_tools(chat_template)
    if parser == "auto":
        parser = _template_format(chat_template) if native else "hermes"
        native = native and parser is not None
        parser = parser or "hermes"
    return FORMATS[parser](native, end_texts)


def renders_tools(chat_template: str | None) -> bool:
    """Whether the chat template reads a `tools` variable (HF's convention for templates that render tools)."""
    if not chat_template:
        return False
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(chat_template))
    except jinja2.TemplateSyntaxError:  # a tag of HF's own ({% generation %}): read the text instead
        return re.search(r"\btools\b", chat_template) is not None


def _template_format(chat_template: str) -> str | None:
    for name, markers in _TEMPLATE_MARKERS:
        if any(marker in chat_template for marker in markers):
            return name
    return None
