"""Tool calling offline: `LLM.chat(messages, params, tools=..., tool_choice=...)` (kvserve/engine/llm.py over
kvserve/engine/tools.py), on a tiny random model with SmolLM2's tokenizer and chat template. The text is gibberish,
so these check validity (every constrained call parses and matches its function's parameters) and shape."""

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from tests.conftest import make_tiny_chat_model

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024)
WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}}
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_chat_model(tmp_path_factory.mktemp("tools") / "tiny-chat")), **ENGINE_OPTIONS)


def sampled(seed: int, **options) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 300, **options})


def assert_valid_calls(completion, names=("get_weather", "add")):
    assert completion.finish_reason == "stop", completion.text
    assert completion.tool_calls, completion.text
    for call in completion.tool_calls:
        assert set(call) == {"id", "name", "arguments"} and call["id"].startswith("call_")
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def assert_pool_empty(llm):
    stats = llm.engine.stats()
    assert stats["num_used_blocks"] == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("tool_choice, names", [
    ("required", ("get_weather", "add")),
    ({"type": "function", "function": {"name": "add"}}, ("add",)),
    ({"type": "function", "function": {"name": "get_weather"}}, ("get_weather",)),
])
def test_required_and_named_calls_match_their_parameters(llm, tool_choice, names):
    output = llm.chat(USER, sampled(4, n=2), tools=TOOLS, tool_choice=tool_choice)
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert_valid_calls(completion, names)
    assert_pool_empty(llm)


def test_one_call_without_parallel_calls_and_a_batch_of_conversations(llm):
    conversations = [USER, [{"role": "system", "content": "Be brief."}, *USER]]
    outputs = llm.chat(conversations, [sampled(seed) for seed in (1, 2)], tools=TOOLS, tool_choice="required",
                       parallel_tool_calls=False)
    assert len(outputs) == 2
    for output in outputs:
        assert_valid_calls(output.outputs[0])
        assert len(output.outputs[0].tool_calls) == 1
    assert "Be brief." in outputs[1].prompt and "<tools>" in outputs[1].prompt


def test_auto_renders_the_tools_and_none_does_not(llm):
    none = llm.chat(USER, sampled(6), tools=TOOLS, tool_choice="none")
    auto = llm.chat(USER, sampled(6), tools=TOOLS)  # "auto" is the default with tools
    plain = llm.chat(USER, sampled(6))
    assert none.outputs[0].tool_calls is None and plain.outputs[0].tool_calls is None
    assert none.prompt_token_ids == plain.prompt_token_ids
    assert len(auto.prompt_token_ids) > len(none.prompt_token_ids) + 100 and '"name": "add"' in auto.prompt
    calls = auto.outputs[0].tool_calls  # a random model rarely writes a well-formed call: the list may be empty
    assert isinstance(calls, list) and all(call["name"] in PARAMETERS for call in calls)


def test_earlier_calls_and_tool_results_render_in_the_tool_format(llm):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    output = llm.chat(messages, sampled(7), tools=TOOLS, tool_choice="required")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in output.prompt
    assert "<tool_response>\n5\n</tool_response>" in output.prompt
    assert_valid_calls(output.outputs[0])
    again = llm.chat(messages, sampled(8), tools=TOOLS, tool_choice="required")
    assert again.num_cached_tokens >= len(output.prompt_token_ids) - 16  # an agent's repeated turn hits the cache


@pytest.mark.parametrize("options, message", [
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice must be 'none', 'auto', 'required' or"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice names function 'nope', which is not in tools"),
    (dict(tools=TOOLS, tool_choice={"function": {"name": "add"}}), "tool_choice must be"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools have two functions of the same name"),
    (dict(tools={"name": "add"}), "tools must be a list"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name must be"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "params": {}}}]),
     "tools[0].function has unknown keys ['params']"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters must be a JSON schema object"),
    (dict(tools=[{"name": "f"}]), "tools[0] must be {'type': 'function'"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls must be true or false"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "integr"}}}],
          tool_choice="required"), "tools: structured_outputs.grammar cannot be compiled"),
])
def test_bad_tool_arguments_are_refused_by_name(llm, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.chat(USER, sampled(0), **options)
    assert_pool_empty(llm)


@pytest.mark.parametrize("messages, message", [
    ([*USER, {"role": "tool", "tool_call_id": "c"}], "messages[1]: a tool message holds the tool's result as text"),
    ([{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0]: 'tool_calls' belongs to assistant messages"),
    ([*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{a"}}]}],
     "messages[1]: tool call 'add' has arguments that are not JSON"),
    ([*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]}],
     "messages[1].tool_calls: each call is"),
])
def test_bad_tool_turns_are_refused_by_name(llm, messages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.chat(messages, sampled(0), tools=TOOLS)
    assert_pool_empty(llm)


def test_structured_outputs_and_tools_do_not_mix(llm):
    params = sampled(0, structured_outputs=StructuredOutputsParams(json_object=True))
    for tool_choice in ("auto", "required"):
        with pytest.raises(ValueError, match="structured_outputs with tools needs tool_choice 'none'"):
            llm.chat(USER, params, tools=TOOLS, tool_choice=tool_choice)
    output = llm.chat(USER, sampled(0, max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True)),
                      tools=TOOLS, tool_choice="none")
    assert output.outputs[0].text.startswith("{") and output.outputs[0].tool_calls is None
    assert_pool_empty(llm)


def test_a_call_cut_by_the_default_max_tokens_is_no_call_and_keeps_its_text(llm):
    output = llm.chat(USER, SamplingParams(), tools=TOOLS, tool_choice="required")  # vLLM's default max_tokens=16
    (completion,) = output.outputs
    assert completion.finish_reason == "length" and len(completion.token_ids) == 16
    assert completion.tool_calls == [] and completion.text.startswith("<tool_call>\n{")
    assert_pool_empty(llm)
