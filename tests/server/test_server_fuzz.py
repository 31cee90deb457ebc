"""Property-based fuzzing of both generation routes (Hypothesis, a bounded number of cases per run): whatever the
body (the routes' own fields with hostile values, random JSON, unknown fields, raw bytes, other content types),
the answer is 2xx or 4xx, never 5xx, and a stream ends in [DONE] without an error event; afterwards the server
answers a good request exactly as the offline engine does and no KV block is in use."""
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_chat_model, scrape_metrics, serve_tiny

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=256, max_num_seqs=4)
NUM_CASES = 250

# ---- values: what a field may hold, plus what a hostile client sends instead ------------------------------
EDGE_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 1e-40, 5e-324, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e308, -1e308]
EDGE_TEXTS = ["", " ", "\ud800", "a\udfff", "\x00", "<|im_end|>", "\u202e", "😀" * 3]
ints = st.one_of(st.integers(-3, 12), st.sampled_from(EDGE_INTS))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EDGE_FLOATS))
texts = st.one_of(st.text(max_size=12), st.sampled_from(EDGE_TEXTS))
json_values = st.recursive(st.none() | st.booleans() | ints | floats | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([-1, 49152, 2**63])), min_size=0, max_size=12)


def field(typed: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right type (edge values included), sometimes anything at all."""
    return st.one_of(typed, typed, typed, json_values)


SHARED = {
    "model": field(st.sampled_from(["tiny-chat", "gpt-4o", None])),
    "temperature": field(st.floats(0, 2) | st.sampled_from(EDGE_FLOATS)),
    "top_p": field(st.floats(0, 1) | st.sampled_from(EDGE_FLOATS)), "top_k": field(ints),
    "min_p": field(st.floats(0, 1) | st.sampled_from(EDGE_FLOATS)), "n": field(st.integers(-1, 5)),
    "seed": field(ints), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "presence_penalty": field(floats), "frequency_penalty": field(floats), "repetition_penalty": field(floats),
    "stop": field(st.one_of(texts, st.lists(texts, max_size=40))),
    "stop_token_ids": field(token_ids), "ignore_eos": field(st.booleans()), "skip_special_tokens": field(st.booleans()),
    "cache_salt": field(texts), "user": field(texts), "logit_bias": field(st.just({})),
    "store": json_values, "metadata": json_values, "parallel_tool_calls": json_values,
}
COMPLETION = {
    **SHARED, "max_tokens": field(st.integers(-2, 8) | st.sampled_from(EDGE_INTS)), "echo": field(st.booleans()),
    "logprobs": field(st.integers(-1, 21)), "best_of": field(st.integers(0, 2)), "suffix": field(texts),
}
CHAT = {
    **SHARED, "max_completion_tokens": field(st.integers(-2, 8) | st.sampled_from(EDGE_INTS)),
    "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 21)),
    "tools": json_values, "response_format": json_values,
}
good_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
good_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=12)
good_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": good_text})
prompts = st.one_of(  # mostly good, so that many requests reach the engine with the other fields' values
    good_text, good_ids, st.lists(good_text, min_size=1, max_size=3), st.lists(good_ids, min_size=1, max_size=3),
    field(st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=3))))
messages = st.one_of(st.lists(good_message, min_size=1, max_size=3), st.lists(good_message, min_size=1, max_size=3),
                     field(st.lists(st.fixed_dictionaries(
                         {"role": field(st.sampled_from(["system", "user", "assistant", "robot"]))},
                         optional={"content": field(st.one_of(texts, st.lists(st.fixed_dictionaries(
                             {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2))),
                             "name": texts}),
                         max_size=4)))
UNKNOWN_FIELDS = ["max_token", "promt", "functions", "x"]


@st.composite
def requests(draw) -> tuple[str, bytes]:
    """A route and a body: the route's required field and up to three others (so that many bodies are valid and
    reach the engine with the others' values), or one in seven times a broken body."""
    path, fields, (required, values) = draw(st.sampled_from([
        ("/v1/completions", COMPLETION, ("prompt", prompts)), ("/v1/chat/completions", CHAT, ("messages", messages))]))
    names = draw(st.lists(st.sampled_from(sorted(fields) + UNKNOWN_FIELDS), max_size=3, unique=True))
    body = {name: draw(fields.get(name, json_values)) for name in names}
    body[required] = draw(values)
    max_tokens_field = "max_tokens" if required == "prompt" else "max_completion_tokens"
    if draw(st.integers(0, 9)) < 9:  # else the default: for chat, the rest of the context (slow, so rarely)
        body.setdefault(max_tokens_field, draw(st.integers(1, 6)))
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 6)) < 6:
        return path, raw
    return path, draw(st.one_of(st.just(raw[: len(raw) // 2]), st.binary(max_size=40), st.integers(100, 100_000).map(
        lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")))


content_types = st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8", "text/plain", None])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("fuzz") / "tiny-chat", max_position_embeddings=256)


@pytest.fixture(scope="module")
def server(model_dir):
    with serve_tiny(model_dir, ENGINE_OPTIONS) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@settings(max_examples=NUM_CASES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(request=requests(), content_type=content_types)
def test_any_body_gets_2xx_or_4xx_never_5xx(http, request, content_type):
    path, body = request
    headers = {"content-type": content_type} if content_type else {}
    with http.stream("POST", path, content=body, headers=headers) as response:
        raw = response.read()
    event(f"status {response.status_code}")  # the mix, with --hypothesis-show-statistics
    assert response.status_code < 500, raw[:500]
    if response.status_code >= 400:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any('"error"' in event[:10] for event in events), events[-3:]


def test_after_the_fuzzing_a_good_request_is_served_and_no_block_is_held(server, http, model_dir):
    # runs after the fuzz test (file order): whatever it sent, the engine is healthy and idle
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(model_dir), **ENGINE_OPTIONS).generate("After the storm", params)[0].outputs[0].text
    good = http.post("/v1/completions", json={"prompt": "After the storm", "temperature": 0, "max_tokens": 8,
                                              "ignore_eos": True})
    assert good.json()["choices"][0]["text"] == expected
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while (metrics := scrape_metrics(server.url, "tiny-chat"))["kvserve:num_used_blocks"] != 0:
        assert time.monotonic() < deadline, "blocks still in use"
        time.sleep(0.02)
    assert metrics["kvserve:num_requests_running"] == metrics["kvserve:num_requests_waiting"] == 0
