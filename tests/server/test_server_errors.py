"""Bad input, missing keys and overload get a 4xx/503 with an OpenAI-style error body naming the problem, and the
server keeps serving. Tiny random model with SmolLM2's tokenizer, as in test_server_api.py."""
import json
import time
from contextlib import ExitStack

import httpx
import openai
import pytest
from openai import OpenAI

from kvserve import LLM, EngineConfig, LLMEngine, SamplingParams
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model, serve_tiny

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024, max_num_seqs=8)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("errors") / "tiny-chat")


def serve(model_dir, **app_options) -> ServerThread:
    return serve_tiny(model_dir, ENGINE_OPTIONS, **app_options)


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir) as server:
        yield server


def completion(prompt="Hello", **fields) -> dict:
    return {"model": "tiny-chat", "prompt": prompt, "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny-chat", "messages": CHAT, "max_tokens": 4, **fields}


BAD_REQUESTS = [
    # (id, path, raw body, status, param, words the message must contain)
    ("malformed-json", "completions", b'{"prompt": "hi",', 400, None, "not valid JSON"),
    ("not-an-object", "completions", b'["hi"]', 400, None, "JSON object"),
    ("missing-prompt", "completions", {"model": "tiny-chat"}, 400, "prompt", "required"),
    ("max-tokens-wrong-type", "completions", completion(max_tokens="ten"), 400, "max_tokens", "integer"),
    ("temperature-wrong-type", "chat/completions", chat(temperature="hot"), 400, "temperature", "number"),
    ("prompt-wrong-shape", "completions", completion(prompt=[1, "a"]), 400, "prompt", "prompt"),
    ("message-bad-role", "chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages.0.role", "role"),
    ("no-messages", "chat/completions", chat(messages=[]), 400, "messages", "at least 1"),
    ("unknown-model", "completions", completion(model="gpt-4o"), 404, "model", "gpt-4o"),
    ("negative-max-tokens", "completions", completion(max_tokens=-1), 400, "max_tokens", "at least 1"),
    ("too-large-max-tokens", "completions", completion(max_tokens=5000), 400, "max_tokens", "max_model_len=1024"),
    ("too-large-max-completion-tokens", "chat/completions", chat(max_completion_tokens=5000), 400,
     "max_completion_tokens", "max_completion_tokens=5000 exceeds max_model_len=1024"),
    ("zero-max-completion-tokens", "chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens",
     "max_completion_tokens must be an integer of at least 1"),
    ("too-large-chat-max-tokens", "chat/completions", chat(max_tokens=5000), 400, "max_tokens",
     "max_tokens=5000 exceeds"),
    ("too-many-top-logprobs", "chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "top_logprobs must be an integer in [0, 20], got 21"),
    ("zero-max-tokens-without-echo", "completions", completion(max_tokens=0), 400, "max_tokens",
     "0 is allowed only with echo"),
    ("prompt-too-long", "completions", completion(prompt=[100] * 1500), 400, "prompt", "max_model_len=1024"),
    ("second-prompt-too-long", "completions", completion(prompt=[[100] * 5, [100] * 1500]), 400, "prompt",
     "prompt 1:"),
    ("token-id-outside-vocab", "completions", completion(prompt=[1, 10**6]), 400, "prompt", "vocabulary"),
    ("n-too-large", "completions", completion(n=9), 400, "n", "max_num_seqs=8"),
    ("top-p-out-of-range", "completions", completion(top_p=1.5), 400, "top_p", "top_p"),
    ("unsupported-best-of", "completions", completion(best_of=3), 400, "best_of", "not supported"),
    ("unsupported-logit-bias", "completions", completion(logit_bias={"50256": -100}), 400, "logit_bias",
     "not supported"),
    ("unsupported-suffix", "completions", completion(suffix="end"), 400, "suffix", "not supported"),
    ("unsupported-legacy-functions", "chat/completions", chat(functions=[{"name": "f"}]), 400, "functions",
     "not supported"),
    ("tool-choice-names-no-tool", "chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice.function.name", "'g'"),
    ("response-format-unknown-type", "chat/completions", chat(response_format={"type": "xml"}), 400,
     "response_format.type", "response_format.type"),
    ("unknown-parameter", "completions", completion(max_token=5), 400, "max_token", "unknown parameter"),
    ("image-content", "chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content", "messages.0.content"),
    ("stream-options-without-stream", "completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options", "stream"),
    ("prompt-logprobs-above-20", "completions", completion(prompt_logprobs=21), 400, "prompt_logprobs", "20"),
    ("top-logprobs-without-logprobs", "chat/completions", chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    # once past validation into the engine step, where they stopped it for everyone (issue 13)
    ("top-k-beyond-int64", "completions", completion(top_k=2**63), 400, "top_k", "below 2**63"),
    ("seed-beyond-int64", "completions", completion(seed=2**64), 400, "seed", "seed"),
    ("cache-salt-lone-surrogate", "completions", b'{"prompt": "hi", "cache_salt": "\\udc80"}', 400, None,
     "surrogate pair"),
    ("prompt-lone-surrogate", "completions", b'{"prompt": "hi \\ud800"}', 400, None, "surrogate pair"),
    ("message-lone-surrogate", "chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None, "surrogate pair"),
    ("json-nested-300-deep", "completions", b'{"prompt": ' + b"[" * 300 + b"]" * 300 + b"}", 400, None,
     "recursion limit"),
    ("json-nested-100k-deep", "completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     "more than 10,000 JSON arrays and objects"),
    ("json-of-20k-tiny-prompts", "completions", completion(prompt=[[7]] * 20_000), 400, None,
     "more than 10,000 JSON arrays and objects"),
    ("temperature-overflows-to-infinity", "completions", b'{"prompt": "hi", "temperature": 1e400}', 400,
     "temperature", "finite"),
    ("temperature-nan", "completions", b'{"prompt": "hi", "temperature": NaN}', 400, None, "not valid JSON"),
    ("repetition-penalty-underflows", "completions", completion(repetition_penalty=1e-40), 400,
     "repetition_penalty", "[0.01, 100]"),
    ("empty-cache-salt", "completions", completion(cache_salt=""), 400, "cache_salt", "at least 1 character"),
    ("too-many-stop-strings", "completions", completion(stop=[f"s{i}" for i in range(33)]), 400, "stop",
     "at most 32"),
    ("too-long-stop-string", "chat/completions", chat(stop="x" * 257), 400, "stop", "at most 256 characters"),
    ("too-many-stop-token-ids", "completions", completion(stop_token_ids=list(range(1025))), 400,
     "stop_token_ids", "at most 1024"),
    ("stop-token-id-outside-vocab", "completions", completion(stop_token_ids=[2, 10**6]), 400, "stop_token_ids",
     "stop_token_ids [1000000] are outside the vocabulary"),
    ("chat-stop-token-id-outside-vocab", "chat/completions", chat(stop_token_ids=[-1]), 400, "stop_token_ids",
     "outside the vocabulary"),
    ("prompt-filling-max-model-len", "completions", completion(prompt=[100] * 1024, max_tokens=1), 400, "prompt",
     "leaves no room to generate"),
    ("best-of-true", "completions", completion(best_of=True), 400, "best_of", "no-op value 1"),
    ("more-prompts-than-max-waiting", "completions", completion(prompt=[[5]] * 257), 400, "prompt",
     "queues at most 256 (--max-waiting)"),
    ("prompt-of-more-characters-than-fit", "completions", completion(prompt="x" * 100_000), 400, "prompt",
     "characters, more than max_model_len=1024 tokens can hold"),
    ("message-of-more-characters-than-fit", "chat/completions",
     chat(messages=[{"role": "user", "content": "x" * 100_000}]), 400, "messages", "characters"),
    ("prompt-of-half-a-million-token-ids", "completions", completion(prompt=[5] * 500_000), 400, "prompt",
     "500000 tokens"),
]


GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[str, str]:
    """What a good greedy request gets, by route: computed offline, so a server that went wrong cannot agree."""
    llm = LLM(str(model_dir), **ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=4, **GREEDY)
    return {"completions": llm.generate("Hello", params)[0].outputs[0].text,
            "chat/completions": llm.chat(CHAT, params).outputs[0].text}


@pytest.mark.parametrize("path, body, status, param, words", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(server, expected, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    good = httpx.post(f"{server.url}/v1/{path}", json=chat(**GREEDY) if path.startswith("chat") else completion(**GREEDY))
    choice = good.json()["choices"][0]
    assert (choice["message"]["content"] if path.startswith("chat") else choice["text"]) == expected[path]


def test_the_openai_client_sees_the_message(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_model_len=1024"):
        client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=5000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_unknown_route_gets_the_same_error_shape(server):
    response = httpx.get(server.url + "/v1/embeddings")
    assert response.status_code in (404, 405) and "error" in response.json()


def test_api_key_guards_v1_but_not_health_or_metrics(model_dir):
    with serve(model_dir, api_key="sesame") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=4)
        assert httpx.post(server.url + "/v1/completions", json=completion()).status_code == 401  # no key at all
        assert httpx.get(server.url + "/v1/models").json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        client = OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=4).choices


def test_full_waiting_queue_answers_503_and_recovers(model_dir):
    # One sequence runs at a time and one may wait: a third concurrent request is refused, not queued.
    long_request = completion(max_tokens=1000, ignore_eos=True, stream=True)
    with ExitStack() as stack:
        server = stack.enter_context(serve(model_dir, max_waiting=1, engine=dict(max_num_seqs=1)))
        http = stack.enter_context(httpx.Client(base_url=server.url, timeout=30))
        running = stack.enter_context(http.stream("POST", "/v1/completions", json=long_request))
        running_lines = running.iter_lines()  # kept: dropping an unfinished line iterator closes the connection
        next(running_lines)  # its first token is out: it holds the only running slot
        queued = stack.enter_context(http.stream("POST", "/v1/completions", json=completion(stream=True)))
        wait_for_metric(server, "kvserve:num_requests_waiting", 1)
        refused = http.post("/v1/completions", json=completion())
        assert refused.status_code == 503
        assert "overloaded" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        running.close()  # the client leaves: its request is aborted and the queued one gets the slot
        assert "data: [DONE]" in list(queued.iter_lines())
        assert http.post("/v1/completions", json=completion()).status_code == 200


def metric(server: ServerThread, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_metric(server: ServerThread, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_engine_failure_fails_requests_and_health_but_not_the_process(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    with ServerThread(build_app(engine)) as server:
        assert httpx.get(server.url + "/health").status_code == 200

        def broken_step():
            raise RuntimeError("injected fault")

        engine.step = broken_step
        failed = httpx.post(server.url + "/v1/completions", json=completion())
        assert failed.status_code == 503 and "injected fault" in failed.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.post(server.url + "/v1/chat/completions", json=chat()).status_code == 503
        assert httpx.get(server.url + "/metrics").status_code == 200
