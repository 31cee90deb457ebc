"""The model's own tool format offline: `LLM.chat(..., tools=...)` on tiny random models whose chat templates write
tools in the Qwen, Llama 3.x and DeepSeek-V3 syntax (tests/engine/tool_templates/, written for these tests; SmolLM2's
tokenizer). The text is gibberish: these check that the template renders the tools, that "required" and named
answers are that format's calls valid against the parameters, and that each parses back into tool_calls."""

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_chat_model

TEMPLATES = Path(__file__).parent / "tool_templates"
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
PARAMETERS = {"add": ADD, "get_weather": WEATHER}
USER = [{"role": "user", "content": "Add two numbers."}]
FORMATS = {"qwen_style.jinja": "<tool_call>", "llama3_style.jinja": '"parameters": {',
           "deepseek_style.jinja": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>"}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def llm(request, tmp_path_factory):
    directory = make_tiny_chat_model(tmp_path_factory.mktemp("formats") / "tiny-chat")
    shutil.copy(TEMPLATES / request.param, directory / "chat_template.jinja")
    llm = LLM(str(directory), kv_cache_memory="64MiB", max_model_len=1024)
    llm.template_name = request.param
    return llm


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200, n=2)


@pytest.mark.parametrize("tool_choice, names", [("required", ("add", "get_weather")),
                                                ({"type": "function", "function": {"name": "add"}}, ("add",))])
def test_constrained_answers_are_the_formats_valid_calls(llm, tool_choice, names):
    # One call each: a random model writing parallel calls rarely stops (their grammar: test_tool_parsers.py).
    output = llm.chat(USER, sampled(3), tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    assert '"get_weather"' in output.prompt.split("Add two numbers.")[0]  # the template rendered the tools
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion.text
        assert FORMATS[llm.template_name] in completion.text
        assert len(completion.tool_calls) == 1, completion.text
        for call in completion.tool_calls:
            assert call["name"] in names
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_auto_parses_and_none_renders_no_tools(llm):
    auto = llm.chat(USER, sampled(5), tools=TOOLS)
    none = llm.chat(USER, sampled(5), tools=TOOLS, tool_choice="none")
    assert '"get_weather"' in auto.prompt and '"get_weather"' not in none.prompt
    assert all(isinstance(c.tool_calls, list) for c in auto.outputs)  # a random model rarely writes a call
    assert all(c.tool_calls is None for c in none.outputs)


def test_a_tool_result_turn_goes_back_through_the_template_and_hits_the_cache(llm):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    first = llm.chat(messages, sampled(7), tools=TOOLS, tool_choice="required")
    again = llm.chat(messages, sampled(8), tools=TOOLS, tool_choice="required")
    assert '{"a": 2, "b": 3}' in first.prompt and "5" in first.prompt.split('{"a": 2, "b": 3}')[1]
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 16
