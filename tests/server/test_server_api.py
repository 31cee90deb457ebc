"""The OpenAI-compatible server, end to end: a real uvicorn server on a free port, the official `openai` client.

The model is a tiny random Llama (2 layers, hidden 64) with SmolLM2's vocabulary, tokenizer and chat template
copied in, so text, stop strings and chat templates are real while a step takes milliseconds. Its text is
gibberish, which is fine: every check compares the server with the offline `LLM` on the same model and options,
or with itself."""

import httpx
import pytest
from openai import OpenAI

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_chat_model, scrape_metrics, serve_tiny

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024)
MAX_TOKENS_GREEDY = 12
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS_GREEDY, extra_body={"ignore_eos": True})
OFFLINE_GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS_GREEDY, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("api") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir):
    with serve_tiny(model_dir, ENGINE_OPTIONS) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), **ENGINE_OPTIONS)


def stream_texts(stream, field="text") -> tuple[dict[int, str], dict[int, str]]:
    """Concatenated text and finish reason per choice index of a completion or chat stream."""
    texts, reasons = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.text if field == "text" else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_models_health_and_metrics_are_served(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "kvserve:kv_cache_usage_perc" in metrics.text


def test_completion_equals_offline_generate(client, offline):
    prompts = ["The capital of France is", "Once upon a time"]
    response = client.completions.create(model="tiny-chat", prompt=prompts, **GREEDY)
    expected = offline.generate(prompts, OFFLINE_GREEDY)
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in response.choices] == ["length", "length"]
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model="tiny-chat", prompt="Streaming is", **GREEDY)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, reasons = stream_texts(chunks[:-1])
    assert texts == {0: whole} and reasons == {0: "length"}
    assert len(chunks) > 3  # really streamed, token by token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_equals_offline_chat_streamed_or_not(client, offline):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    expected = offline.chat(messages, OFFLINE_GREEDY).outputs[0].text
    response = client.chat.completions.create(model="tiny-chat", messages=messages, **GREEDY)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected
    stream = client.chat.completions.create(model="tiny-chat", messages=messages, stream=True, **GREEDY)
    assert stream_texts(stream, "delta") == ({0: expected}, {0: "length"})


def test_n2_gives_two_seeded_choices_equal_to_offline(client, offline):
    sampled = dict(temperature=1.0, max_tokens=10, seed=7, n=2, extra_body={"ignore_eos": True})
    expected = offline.generate("Two roads", SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=7,
                                                            ignore_eos=True))[0].outputs
    response = client.completions.create(model="tiny-chat", prompt="Two roads", **sampled)
    assert [(c.index, c.text) for c in response.choices] == [(0, expected[0].text), (1, expected[1].text)]
    assert expected[0].text != expected[1].text
    texts, _ = stream_texts(client.completions.create(model="tiny-chat", prompt="Two roads", stream=True, **sampled))
    assert texts == {0: expected[0].text, 1: expected[1].text}
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], **sampled)
    assert len({c.message.content for c in chat.choices}) == 2


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny-chat", prompt="Stop me", **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    kwargs = dict(model="tiny-chat", prompt="Stop me", stop=[stop], **GREEDY)
    choice = client.completions.create(**kwargs).choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert stream_texts(client.completions.create(stream=True, **kwargs)) == ({0: expected}, {0: "stop"})


def test_same_seed_same_text_other_seed_other_text(client):
    def sample(seed):
        return client.completions.create(model="tiny-chat", prompt="Random", temperature=1.0, max_tokens=12,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_three_turn_chat_reuses_the_cached_conversation(client):
    # A fresh cache salt keeps other tests' blocks out: turn 1 starts cold, later turns hit its blocks.
    messages, cached = [], []
    for question in ["Hello, who are you?", "What do you cache?", "And for how long?"]:
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model="tiny-chat", messages=messages, temperature=0, max_tokens=12,
                                                  extra_body={"ignore_eos": True, "cache_salt": "three-turns"})
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0
    assert 0 < cached[1] < cached[2]


def test_echo_and_logprobs(client):
    echoed = client.completions.create(model="tiny-chat", prompt="Echo this", echo=True, **GREEDY).choices[0].text
    plain = client.completions.create(model="tiny-chat", prompt="Echo this", **GREEDY).choices[0].text
    assert echoed == "Echo this" + plain
    response = client.completions.create(model="tiny-chat", prompt="Echo this", logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) >= 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(entry.top_logprobs) == 2 for entry in content)


def scrape(server) -> dict[str, float]:
    return scrape_metrics(server.url, "tiny-chat")


def test_metrics_count_what_was_served(server, client):
    before = scrape(server)
    response = client.completions.create(model="tiny-chat", prompt="Count me in the metrics", n=2, **GREEDY)
    after = scrape(server)

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew("kvserve:prompt_tokens_total") == response.usage.prompt_tokens
    assert grew("kvserve:prefix_cache_queries_total") == response.usage.prompt_tokens
    assert grew("kvserve:generation_tokens_total") == response.usage.completion_tokens == 24
    assert grew("kvserve:time_to_first_token_seconds_count") == 1
    assert grew("kvserve:inter_token_latency_seconds_count") == MAX_TOKENS_GREEDY - 1
    assert grew('kvserve:request_success_total{finished_reason="length"}') == 1
    assert after["kvserve:num_blocks"] == after["kvserve:num_free_blocks"] > 0
    assert after["kvserve:kv_cache_usage_perc"] == after["kvserve:num_used_blocks"] == 0
    assert after["kvserve:num_cached_blocks"] > 0  # finished requests leave their full blocks indexed
    for name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:num_preemptions_total",
                 "kvserve:prefix_cache_hits_total", "kvserve:e2e_request_latency_seconds_count"):
        assert name in after


def test_prompt_logprobs_and_echo_with_logprobs_give_the_engines_prompt_logprobs(server, client, offline):
    prompt = "The cache holds keys and values"
    expected = offline.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    response = httpx.post(server.url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "echo": True, "logprobs": 1}).json()
    choice = response["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected)
    for entry, want in zip(got[1:], expected[1:]):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(want)
    echoed = choice["logprobs"]
    assert echoed["token_logprobs"][0] is None and len(echoed["tokens"]) == len(expected) + 1  # prompt + 1 token
    prompt_ids = offline.tokenizer(prompt).input_ids
    assert echoed["token_logprobs"][1:len(expected)] == pytest.approx(
        [want[t] for t, want in zip(prompt_ids[1:], expected[1:])])

    stream = httpx.post(server.url + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 3, "prompt_logprobs": 2, "stream": True}).text
    assert stream.count('"prompt_logprobs"') == 1  # with the first chunk only


def test_prompt_logprobs_beyond_twenty_are_refused(server):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "prompt_logprobs": 21})
    assert response.status_code == 400 and "prompt_logprobs" in response.text
