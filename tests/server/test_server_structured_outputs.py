"""response_format, structured_outputs and tools through the official `openai` client against a running server, on a
tiny random model with SmolLM2's tokenizer and chat template: the text is gibberish, so these check validity and
protocol shape (outputs that parse and validate, tool calls the client assembles), never the model's judgement."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from kvserve import EngineConfig, LLMEngine
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model, scrape_metrics, serve_tiny

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024)
WEATHER = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a", "b"], "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SCHEMAS = [
    {"type": "object", "required": ["user", "tags"], "additionalProperties": False, "properties": {
        "user": {"type": "object", "required": ["name", "role"], "additionalProperties": False, "properties": {
            "name": {"type": "string", "maxLength": 10}, "role": {"enum": ["admin", "guest"]}}},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 3}}},
    {"type": "object", "required": ["price", "code"], "additionalProperties": False, "properties": {
        "price": {"type": "integer", "minimum": 10, "maximum": 500},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}},
]
USER = [{"role": "user", "content": "Hello there"}]
SAMPLED = dict(model="tiny-chat", temperature=1.0, max_tokens=150)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(make_tiny_chat_model(tmp_path_factory.mktemp("structured") / "tiny-chat"), ENGINE_OPTIONS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_chat_json_schema_outputs_validate(client, index):
    response = client.chat.completions.create(messages=USER, n=2, seed=index, logprobs=True,
                                              response_format=json_schema_format(SCHEMAS[index]), **SAMPLED)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[index])
        assert choice.logprobs.content and all(entry.logprob <= 0 for entry in choice.logprobs.content)


def test_repeated_schemas_compile_once(server, client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    names = ["kvserve:grammars_compiled_total", "kvserve:constrained_requests_total",
             "kvserve:grammar_cache_hits_total", "kvserve:grammar_compile_seconds_total",
             "kvserve:invalid_constrained_outputs_total"]
    before = [scrape_metrics(server.url, "tiny-chat")[name] for name in names]
    for seed in range(3):
        response = client.chat.completions.create(messages=USER, seed=seed, response_format=json_schema_format(schema),
                                                  **SAMPLED)
        jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    compiled, requests, hits, seconds, invalid = (scrape_metrics(server.url, "tiny-chat")[name] - was
                                                  for name, was in zip(names, before))
    assert (compiled, requests, hits, invalid) == (1, 3, 2, 0) and seconds > 0


def test_completions_json_object_and_structured_outputs(client):
    # any JSON object has unbounded strings, which a random model rarely closes: its opening shows the constraint
    response = client.completions.create(prompt="JSON:", seed=1, extra_body={"response_format": {
        "type": "json_object"}}, **{**SAMPLED, "max_tokens": 3})
    assert response.choices[0].text.startswith("{") and response.choices[0].finish_reason == "length"
    response = client.completions.create(prompt="JSON:", seed=1, extra_body={"response_format": json_schema_format(
        SCHEMAS[1])}, **SAMPLED)
    jsonschema.validate(json.loads(response.choices[0].text), SCHEMAS[1])
    response = client.completions.create(prompt="Pick:", seed=2, extra_body={"structured_outputs": {
        "choice": ["alpha", "beta"]}}, **SAMPLED)
    assert response.choices[0].text in ("alpha", "beta")


def test_streamed_json_schema_output_validates(client):
    stream = client.chat.completions.create(messages=USER, seed=3, stream=True,
                                            response_format=json_schema_format(SCHEMAS[1]), **SAMPLED)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("response_format, param", [
    (json_schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}), "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_invalid_schemas_are_400_naming_the_field(client, response_format, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(messages=USER, response_format=response_format, **SAMPLED)
    assert raised.value.body["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integr"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": USER, "max_tokens": 5, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def assert_valid_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_constrained_tool_calls_non_streamed(client, tool_choice):
    response = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice=tool_choice, seed=4,
                                              **SAMPLED)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls, ["add"] if isinstance(tool_choice, dict) else None)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_tool_calls_streamed_assemble_in_the_client(client, tool_choice):
    with client.chat.completions.stream(messages=USER, tools=TOOLS, tool_choice=tool_choice, seed=5,
                                        **SAMPLED) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls, ["get_weather"] if isinstance(tool_choice, dict) else None)


def test_streamed_calls_of_two_choices_stay_apart(client):
    with client.chat.completions.stream(messages=USER, tools=TOOLS, tool_choice="required", seed=10, n=2,
                                        parallel_tool_calls=False, **SAMPLED) as stream:
        final = stream.get_final_completion()
    assert [c.index for c in final.choices] == [0, 1]
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls)


def test_parallel_calls_only_when_allowed(client):
    for seed in range(4):
        single = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice="required", seed=seed,
                                                parallel_tool_calls=False, **SAMPLED)
        assert len(single.choices[0].message.tool_calls) == 1


def test_tool_choice_none_and_auto_answer_in_text(client):
    none = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice="none", seed=6, **SAMPLED)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(messages=USER, tools=TOOLS, tool_choice="auto", seed=6, **SAMPLED)
    message = auto.choices[0].message  # a random model rarely writes a well-formed call: either answer is valid
    assert message.tool_calls is None or auto.choices[0].finish_reason == "tool_calls"
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens + 100  # "auto" renders the tools, "none" does not


def test_tool_result_turns_are_accepted(client):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    response = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="required", seed=7,
                                              **SAMPLED)
    assert_valid_calls(response.choices[0].message.tool_calls)
    assert response.usage.prompt_tokens > 100  # the instructions, the earlier call and its result were rendered
    again = client.chat.completions.create(messages=messages, tools=TOOLS, tool_choice="required", seed=8,
                                           **SAMPLED)
    assert again.usage.prompt_tokens_details.cached_tokens >= response.usage.prompt_tokens - 16  # an agent's turns hit


def test_constrained_beside_unconstrained_in_one_batch(server):
    greedy = {"messages": USER, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    url = server.url + "/v1/chat/completions"
    alone = httpx.post(url, json=greedy, timeout=60).json()["choices"][0]["message"]["content"]

    async def both():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(
                http.post(url, json=greedy),
                http.post(url, json={**greedy, "ignore_eos": False, "max_tokens": 150,
                                     "response_format": json_schema_format(SCHEMAS[1])}))

    plain, constrained = asyncio.run(both())
    assert plain.json()["choices"][0]["message"]["content"] == alone
    jsonschema.validate(json.loads(constrained.json()["choices"][0]["message"]["content"]), SCHEMAS[1])


def test_speculating_server_verifies_no_draft_the_grammar_cannot_take(tmp_path):
    """Drafts of a special token, which no JSON output takes: cut before verification for the constrained request
    (tests/engine/test_structured.py verifies drafts the grammar takes), verified for the plain one."""
    model_dir = make_tiny_chat_model(tmp_path / "tiny-chat")
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS,
                                    speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'))
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")  # not an end token
    engine.speculator.lookup = lambda seq, limit: [special] * limit  # a random model never repeats: always draft
    with ServerThread(build_app(engine)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(messages=USER, seed=9, response_format=json_schema_format(
            SCHEMAS[0]), **SAMPLED)
        jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMAS[0])
        assert scrape_metrics(server.url, "tiny-chat")["kvserve:spec_decode_num_draft_tokens_total"] == 0
        client.completions.create(prompt="a b", max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                  model="tiny-chat")
        assert scrape_metrics(server.url, "tiny-chat")["kvserve:spec_decode_num_draft_tokens_total"] > 0
