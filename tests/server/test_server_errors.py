"""Bad input, missing keys and overload get a 4xx/503 with an OpenAI-style error body naming the problem, and the
server keeps serving. Tiny random model with SmolLM2's tokenizer, as in test_server_api.py."""
import json
import time
from contextlib import ExitStack

import httpx
import openai
import pytest
from openai import OpenAI

from kvserve import LLMEngine, EngineConfig
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024, max_num_seqs=8)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("errors") / "tiny-chat")


def serve(model_dir, **app_options) -> ServerThread:
    engine = LLMEngine(EngineConfig(model=str(model_dir), **{**ENGINE_OPTIONS, **app_options.pop("engine", {})}))
    return ServerThread(build_app(engine, **app_options))


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
    ("too-large-max-completion-tokens", "chat/completions", chat(max_completion_tokens=5000), 400, "max_tokens",
     "max_model_len=1024"),
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
    ("unsupported-tools", "chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools", "not supported"),
    ("unsupported-response-format", "chat/completions", chat(response_format={"type": "json_object"}), 400,
     "response_format", "not supported"),
    ("unknown-parameter", "completions", completion(max_token=5), 400, "max_token", "unknown parameter"),
    ("image-content", "chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content", "messages.0.content"),
    ("stream-options-without-stream", "completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options", "stream"),
    ("echo-with-logprobs", "completions", completion(echo=True, logprobs=1), 400, "echo", "prompt logprobs"),
    ("top-logprobs-without-logprobs", "chat/completions", chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
]


@pytest.mark.parametrize("path, body, status, param, words", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error_and_the_server_goes_on(server, path, body, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"]
    good = httpx.post(f"{server.url}/v1/{path}", json=chat() if path.startswith("chat") else completion())
    assert good.status_code == 200


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
