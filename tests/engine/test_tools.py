"""kvserve's default tool-call format (Hermes-style, kvserve/engine/tool_parsers/hermes.py) and the ToolRequest over it
(kvserve/engine/tools.py): rendering, whole-text and streamed parsing."""

import json

from kvserve.engine import tools
from kvserve.engine.tool_parsers import hermes

HERMES = hermes.Hermes(native=False)

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_parse_splits_calls_from_text():
    content, calls = HERMES.parse(f"Sure.\n{CALL}\n{CALL.replace('add', 'sub')}")
    assert content == "Sure."
    assert [c.name for c in calls] == ["add", "sub"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert len({c.id for c in calls}) == 2


def test_parse_leaves_malformed_blocks_as_text():
    text = "<tool_call>{not json}</tool_call> and <tool_call>{\"arguments\": {}}</tool_call>"
    assert HERMES.parse(text) == (text, [])


def test_stream_parser_holds_back_a_possible_opening_and_emits_each_call_once():
    text = f"Hi <b> {CALL}{CALL} bye"
    for step in (1, 3, 7, len(text)):
        parser = HERMES.stream_parser()
        content, calls = "", []
        for start in range(0, len(text), step):
            piece, done = parser.feed(text[start:start + step])
            assert "<tool_call" not in piece
            content += piece
            calls += done
        content += parser.flush()[0]
        assert [c.name for c in calls] == ["add", "add"]
        assert content.replace(" ", "") == "Hi<b>bye"


def test_stream_parser_flushes_an_unclosed_call():
    parser = HERMES.stream_parser()
    content, calls = parser.feed('<tool_call>{"name": "a')
    assert (content, calls) == ("", [])
    assert parser.flush() == ('<tool_call>{"name": "a', [])


def test_earlier_calls_and_results_render_as_text():
    assert hermes.call_text("add", '{"a": 1}') == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert "<tool_response>\n5\n</tool_response>" == hermes.result_text("5")
    messages = tools.with_tools([{"role": "user", "content": "q"}], [{"name": "add", "parameters": {}}])
    assert messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    messages = tools.with_tools([{"role": "system", "content": "Be brief."}], [{"name": "add"}])
    assert len(messages) == 1 and messages[0]["content"].endswith("\n\nBe brief.")


FUNCTIONS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}, "strict": True}}
             for n in ("add", "sub")]


def test_tool_request_modes_and_their_grammars():
    assert tools.ToolRequest.from_openai(None).mode == "none"
    assert tools.ToolRequest.from_openai(FUNCTIONS).mode == "auto"  # OpenAI's default with tools
    assert tools.ToolRequest.from_openai(FUNCTIONS, "auto").constraint() is None
    assert tools.ToolRequest.from_openai(FUNCTIONS, "none").constraint() is None
    assert tools.ToolRequest.from_openai(FUNCTIONS, "none").calls(CALL) is None
    required = tools.ToolRequest.from_openai(FUNCTIONS, "required").constraint().grammar
    assert '"add"' in required and '"sub"' in required and '("\\n" call)*' in required
    single = tools.ToolRequest.from_openai(FUNCTIONS, "required", parallel_tool_calls=False).constraint().grammar
    assert '("\\n" call)*' not in single
    named = tools.ToolRequest.from_openai(FUNCTIONS, {"type": "function", "function": {"name": "sub"}})
    assert named.mode == "named" and '"sub"' in named.constraint().grammar and '"add"' not in named.constraint().grammar
    assert [f["name"] for f in named.functions] == ["add", "sub"]  # every function is still rendered
    assert "strict" not in named.functions[0]


def test_tool_request_calls_and_turns():
    request = tools.ToolRequest.from_openai(FUNCTIONS, "auto")
    (call,) = request.calls(f"ok {CALL}")
    assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 1, "b": 2}
    assert request.calls("no call here") == []
    turns = request.messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "c", "content": "3"}])
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[2] == {"role": "assistant", "content": hermes.call_text("add", "{}")}
    assert turns[3]["content"] == hermes.result_text("3")
