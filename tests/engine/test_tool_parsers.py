"""The tool-call formats (kvserve/engine/tool_parsers/): each chosen from a chat template that writes it, parsing
its calls whole and streamed, its grammar allowing exactly what its parser reads, and earlier calls rendered by the
template the way the parser reads them back. The templates in tests/engine/tool_templates/ are small ones written
for these tests with each family's tool syntax; the tokenizer is the embedded SmolLM2's (no network)."""

import json
from pathlib import Path

import pytest
import transformers

from kvserve.engine import tool_parsers
from kvserve.engine.chat_prompt import render_chat
from kvserve.engine.structured import GrammarCompiler
from kvserve.engine.tools import ToolRequest
from kvserve.model.loader import resolve_model

TEMPLATES = Path(__file__).parent / "tool_templates"
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
FUNCTIONS = [{"name": "add", "parameters": ADD}, {"name": "echo", "parameters": {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}}]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
# Two calls, add(a=1, b=2) then echo(text="hi"), as each format writes them.
TWO_CALLS = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "echo", "parameters": {"text": "hi"}}',
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1, "b": 2}\n'
                   '```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>echo\n```json\n{"text": "hi"}\n'
                   '```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}
TEMPLATE_OF = {"hermes": "qwen_style.jinja", "llama3_json": "llama3_style.jinja", "deepseek_v3": "deepseek_style.jinja"}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)


def native(name: str) -> tool_parsers.ToolFormat:
    return tool_parsers.FORMATS[name](native=True)


def assert_two_calls(calls):
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("echo", {"text": "hi"})]


@pytest.mark.parametrize("name", TEMPLATE_OF)
def test_auto_picks_the_format_the_chat_template_writes(name):
    chosen = tool_parsers.choose("auto", (TEMPLATES / TEMPLATE_OF[name]).read_text())
    assert (chosen.name, chosen.native) == (name, True)


def test_a_template_without_tools_gets_kvserves_default_written_into_the_system_turn(tokenizer):
    chosen = tool_parsers.choose("auto", tokenizer.chat_template)  # the embedded SmolLM2's
    assert (chosen.name, chosen.native) == ("hermes", False)
    assert tool_parsers.choose("hermes", (TEMPLATES / "qwen_style.jinja").read_text()).native


def test_a_format_the_template_cannot_render_and_unknown_names_are_refused_naming_the_fix(tokenizer):
    with pytest.raises(ValueError, match="needs a chat template that renders tools.*--tool-call-parser hermes"):
        tool_parsers.choose("llama3_json", tokenizer.chat_template)
    with pytest.raises(ValueError, match="must be one of auto, hermes, llama3_json, deepseek_v3"):
        tool_parsers.choose("mistral", None)


@pytest.mark.parametrize("name", TWO_CALLS)
def test_each_format_parses_its_calls_whole_and_streamed_in_any_pieces(name):
    tool_format = native(name)
    content, calls = tool_format.parse(TWO_CALLS[name])
    assert content == ""
    assert_two_calls(calls)
    for step in (1, 2, 5, 13):
        parser, streamed, calls = tool_format.stream_parser(), "", []
        for start in range(0, len(TWO_CALLS[name]), step):
            piece, done = parser.feed(TWO_CALLS[name][start:start + step])
            streamed, calls = streamed + piece, calls + done
        rest, done = parser.flush()
        assert streamed + rest == ""
        assert_two_calls(calls + done)


@pytest.mark.parametrize("name", TWO_CALLS)
def test_answers_that_are_not_calls_stay_content(name):
    tool_format = native(name)
    broken = TWO_CALLS[name].replace("}", "")  # no call's JSON closes
    for text in ("Just text, no call.", broken):
        assert tool_format.parse(text) == (text, [])
        parser = tool_format.stream_parser()
        content, calls = parser.feed(text)
        rest, more = parser.flush()
        assert (content + rest, calls + more) == (text, [])


@pytest.mark.parametrize("name", TWO_CALLS)
def test_the_grammar_allows_what_the_parser_reads_and_not_a_wrong_argument(tokenizer, name):
    compiler = GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id}))
    grammar = compiler.compile(native(name).grammar(FUNCTIONS, parallel=True))
    matcher = grammar.new_matcher()
    for token_id in tokenizer(TWO_CALLS[name], add_special_tokens=False).input_ids:
        matcher.accept(token_id)
    assert matcher.llmatcher.is_accepting()
    single = compiler.compile(native(name).grammar(FUNCTIONS, parallel=False)).new_matcher()
    wrong = TWO_CALLS[name].replace('"b": 2', '"b": "2"')
    with pytest.raises(RuntimeError, match="rejected"):
        for token_id in tokenizer(wrong, add_special_tokens=False).input_ids:
            single.accept(token_id)


@pytest.mark.parametrize("name", TWO_CALLS)
def test_the_template_renders_tools_and_earlier_calls_as_the_parser_reads_them(name):
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)
    tokenizer.chat_template = (TEMPLATES / TEMPLATE_OF[name]).read_text()
    request = ToolRequest.from_openai(TOOLS, "auto", tool_format=tool_parsers.choose("auto", tokenizer.chat_template))
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate([("add", {"a": 1, "b": 2}), ("echo", {"text": "hi"})])]
    messages = request.messages([{"role": "user", "content": "Add 1 and 2, then say hi."},
                                 {"role": "assistant", "content": None, "tool_calls": calls},
                                 {"role": "tool", "tool_call_id": "call_0", "content": "3"},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "hi"}])
    prompt = render_chat(tokenizer, messages, request.template_tools())
    assert TWO_CALLS[name] in prompt
    assert '"name": "echo"' in prompt.split("Add 1 and 2")[0]  # the tools, rendered before the question
    none = ToolRequest.from_openai(TOOLS, "none", tool_format=request.format)
    assert none.template_tools() is None
