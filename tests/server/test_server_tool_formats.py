"""The model's own tool format through the server and the official `openai` client: a tiny random model whose chat
template writes Llama 3.x JSON calls (tests/engine/tool_templates/llama3_style.jinja, written for these tests),
picked by `--tool-call-parser auto`; `--no-enable-auto-tool-choice` as vLLM without `--enable-auto-tool-choice`;
a parser the template cannot render refused at start. Gibberish text: validity and protocol shape only."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from kvserve.cli import build_parser
from tests.conftest import make_tiny_chat_model, serve_tiny

TEMPLATE = Path(__file__).parents[1] / "engine" / "tool_templates" / "llama3_style.jinja"
ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024)
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]
USER = [{"role": "user", "content": "Add two numbers."}]
SAMPLED = dict(model="tiny-chat", temperature=1.0, max_tokens=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = make_tiny_chat_model(tmp_path_factory.mktemp("formats") / "tiny-chat")
    shutil.copy(TEMPLATE, directory / "chat_template.jinja")
    return directory


@pytest.fixture(scope="module")
def client(model_dir):
    with serve_tiny(model_dir, ENGINE_OPTIONS) as server:
        yield OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_add_call(call):
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_named_call_in_the_templates_format_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "add"}}
    answer = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice=choice, seed=1, **SAMPLED)
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls
    assert_add_call(call)
    with client.chat.completions.stream(messages=USER, tools=TOOLS, tool_choice=choice, seed=2, **SAMPLED) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert_add_call(final.choices[0].message.tool_calls[0])


def test_required_with_a_tool_result_turn_and_auto(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    answer = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, seed=3, **SAMPLED)
    assert answer.choices[0].finish_reason == "tool_calls" and len(answer.choices[0].message.tool_calls) == 1
    auto = client.chat.completions.create(messages=USER, tools=TOOLS, seed=4, **SAMPLED)
    message = auto.choices[0].message  # a random model rarely writes a call: text, or calls that parsed
    assert message.tool_calls is None or all(c.function.name in ("add", "noop") for c in message.tool_calls)


def test_a_call_cut_by_max_tokens_is_content_with_finish_reason_length(client):
    choice = {"type": "function", "function": {"name": "add"}}
    answer = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice=choice, seed=6,
                                            **{**SAMPLED, "max_tokens": 6})
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "length" and message.tool_calls is None
    assert message.content.startswith('{"name": "add"')  # the raw text generated so far
    chunks = list(client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice=choice, seed=6,
                                                 stream=True, **{**SAMPLED, "max_tokens": 6}))
    deltas = [chunk.choices[0] for chunk in chunks]
    assert deltas[-1].finish_reason == "length" and not any(d.delta.tool_calls for d in deltas)
    assert "".join(d.delta.content or "" for d in deltas) == message.content  # held back, then sent as content


def test_without_auto_tool_choice_auto_is_a_400_and_required_still_works(model_dir):
    with serve_tiny(model_dir, ENGINE_OPTIONS, auto_tool_choice=False) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(messages=USER, tools=TOOLS, **SAMPLED)
        assert raised.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in str(raised.value)
        answer = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, seed=5, **SAMPLED)
        assert answer.choices[0].message.tool_calls
        plain = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3}, timeout=60)
        assert plain.status_code == 200


def test_serve_flags_as_vllm_spells_them(tmp_path):
    parse = build_parser(["serve"]).parse_args
    assert (parse(["serve"]).tool_call_parser, parse(["serve"]).auto_tool_choice) == ("auto", True)
    args = parse(["serve", "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"])
    assert (args.tool_call_parser, args.auto_tool_choice) == ("llama3_json", True)
    assert parse(["serve", "--no-enable-auto-tool-choice"]).auto_tool_choice is False
    smollm_dir = make_tiny_chat_model(tmp_path / "tiny-chat")  # SmolLM2's template renders no tools
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(smollm_dir), "--port", "0",
                             "--kv-cache-memory", "64MiB", "--tool-call-parser", "deepseek_v3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "--tool-call-parser deepseek_v3 needs a chat template that renders tools" in result.stderr
