"""Concurrent clients of every kind against a server whose pool holds about 1.3 of the longest requests (requests
wait for blocks, and running ones are preempted as they overlap), each finished response compared with the same
body sent alone to a server with room to spare: completions and chat, streamed and not, n = 2, greedy and seeded
samples, logprobs, stop strings, penalties, a JSON schema and a required tool call, and clients that hang up
mid-stream or give up waiting. Afterwards no KV block or state slot is held and nothing runs or waits. Tiny random
models with SmolLM2's tokenizer: a plain one with prompt-lookup speculation, and a hybrid (Gated DeltaNet) one.

The bodies, their delays and when each client leaves are seeded; how the requests overlap depends on timing, which
the responses must not: greedy and seeded outputs are the same batched or alone (tests/engine/test_mixed_load.py),
so they must be equal, streams compared as the text, tool calls and log-probabilities they add up to
(log-probabilities to 1e-3: batched and alone round differently)."""
import asyncio
import json
import random
import time

import httpx
import pytest

from kvserve import EngineConfig, LLMEngine
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import add_chat_tokenizer, make_tiny_chat_model, scrape_metrics
from tests.model.test_qwen3_next import make_hybrid_model

MODEL = "tiny-chat"
WORDS = "the cache pages blocks tokens model serve attention state prefix hit miss keys values heads layer".split()
ADD = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
NUM_CLIENTS = 24
MAX_MODEL_LEN = 240
POOL_BLOCKS = 20  # one longest request and a third
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def bodies(rng: random.Random) -> list[tuple[dict, float | int | None, float]]:
    """(body, when its client leaves: after that many stream events, or after that many seconds; None: it stays,
    delay before it sends)."""
    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prefixes = [words(rng.randint(20, 60)) for _ in range(3)]
    load = []
    for i in range(NUM_CLIENTS):
        text = (rng.choice(prefixes) + " " if rng.random() < 0.7 else "") + words(rng.randint(1, 30))
        seeded = rng.random() < 0.5
        body = {"model": MODEL, "max_tokens": rng.randint(1, 30), "stream": rng.random() < 0.5,
                "temperature": 0.8 if seeded else 0, "ignore_eos": rng.random() < 0.7}
        if seeded:
            body["seed"] = i
        if rng.random() < 0.25:
            body["n"] = 2
        if rng.random() < 0.15:
            body["presence_penalty"] = 0.5
        if rng.random() < 0.5:
            body["messages"] = [{"role": "system", "content": prefixes[0]}, {"role": "user", "content": text}]
            if rng.random() < 0.2:
                body |= {"logprobs": True, "top_logprobs": 2}
            constraint = rng.random()
            if constraint < 0.15:
                body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": ADD}},
                         "max_tokens": 40}
            elif constraint < 0.25:
                body |= {"tools": TOOLS, "tool_choice": "required", "max_tokens": 40}
            elif rng.random() < 0.15:
                body["stop"] = [rng.choice(WORDS)]
        else:
            body["prompt"] = text
            if rng.random() < 0.2:
                body["logprobs"] = 2
            if rng.random() < 0.15:
                body["stop"] = [rng.choice(WORDS)]
        leave = None
        if rng.random() < 0.3:
            leave = rng.randint(1, 4) if body["stream"] else rng.uniform(0.05, 1.0)
        load.append((body, leave, rng.uniform(0, 3)))
    return load


def strip(value):
    """A response without what differs between any two sends (ids, times, cached-token counts)."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items()
                if k not in ("id", "created", "system_fingerprint", "prompt_tokens_details",
                             "kvserve_cached_tokens_by_tier")}
    return [strip(v) for v in value] if isinstance(value, list) else value


def assemble(events: list[dict]) -> dict:
    """A stream's choices as the text, tool-call pieces, finish reason and log-probabilities they add up to, and its
    usage: how the events group tokens depends on the load, what they add up to does not."""
    choices, usage = {}, None
    for event in events:
        usage = strip(event.get("usage")) or usage
        for choice in event["choices"]:
            c = choices.setdefault(choice["index"], {"text": "", "tools": [], "finish": None, "logprobs": []})
            delta = choice.get("delta") or {}
            c["text"] += choice.get("text") or delta.get("content") or ""
            c["tools"] += strip(delta.get("tool_calls") or [])
            c["finish"] = choice["finish_reason"] or c["finish"]
            logprobs = choice.get("logprobs") or {}
            c["logprobs"] += logprobs.get("content") or list(zip(*(logprobs.get(k, []) for k in (
                "tokens", "token_logprobs", "top_logprobs", "text_offset"))))
    return {"choices": choices, "usage": usage}


async def send(client: httpx.AsyncClient, body: dict, leave=None):
    """("ok", response) or ("status", code, error), or ("left",) when the client hung up first."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        try:
            response = await client.post(path, json=body, timeout=leave)
        except httpx.TimeoutException:
            return ("left",)
        if response.status_code != 200:
            return ("status", response.status_code, response.json()["error"]["message"])
        return ("ok", strip({k: v for k, v in response.json().items() if k in ("choices", "usage")}))
    events = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return ("status", response.status_code, json.loads(await response.aread())["error"]["message"])
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if leave is not None and len(events) >= leave:
                    return ("left",)
    return ("ok", assemble(events))


def equal(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-3
    return a == b


async def alone(url: str, load) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return [await send(client, body) for body, _, _ in load]


async def together(url: str, load) -> list:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        async def client_of(body, leave, delay):
            await asyncio.sleep(delay)
            return await send(client, body, leave)
        return await asyncio.gather(*(client_of(*x) for x in load))


def make_model(directory, kind: str) -> str:
    if kind == "hybrid":
        return str(add_chat_tokenizer(make_hybrid_model(directory, "qwen3_5", vocab_size=49152)))
    return str(make_tiny_chat_model(directory, kind=kind))


@pytest.mark.parametrize("kind, seed, options", [
    ("llama-gqa", 11, {"speculative_config": NGRAM}),
    ("hybrid", 12, {"max_num_seqs": 3}),
])
def test_concurrent_clients_get_what_they_get_alone(tmp_path, kind, seed, options):
    rng = random.Random(seed)
    model = make_model(tmp_path / "model", kind)
    load = bodies(rng)
    spare = LLMEngine(EngineConfig(model=model, kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN,
                                   enable_prefix_caching=False))
    with ServerThread(build_app(spare, served_model_name=MODEL)) as server:
        expected = asyncio.run(alone(server.url, load))
    state = spare.cache_plan.state
    memory = spare.cache_plan.block_bytes * POOL_BLOCKS + (state.total_bytes if state else 0)
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=memory, max_model_len=MAX_MODEL_LEN,
                                    max_num_batched_tokens=rng.choice([32, 48, 64]), **options))
    with ServerThread(build_app(engine, served_model_name=MODEL)) as server:
        got = asyncio.run(together(server.url, load))
        deadline = time.monotonic() + 10  # a hung-up client's request is aborted by the engine thread, soon
        while (metrics := scrape_metrics(server.url, MODEL))["kvserve:num_used_blocks"] != 0:
            assert time.monotonic() < deadline, "blocks still held after the load"
            time.sleep(0.05)
    stayed = [i for i, result in enumerate(got) if result != ("left",)]
    assert len(stayed) >= NUM_CLIENTS // 2 and any(r[0] == "ok" for r in expected)
    for i in stayed:
        assert equal(got[i], expected[i]), f"client {i}: {load[i][0]}"
    assert metrics["kvserve:num_requests_running"] == metrics["kvserve:num_requests_waiting"] == 0
    # the load did what it is for: hit cached prefixes (through checkpoints on the hybrid), drafted (whether and
    # how often it preempts depends on how the clients' requests overlap)
    assert metrics["kvserve:prefix_cache_hits_total"] > 0
    if state:
        assert metrics["kvserve:num_free_state_slots"] == metrics["kvserve:num_state_slots"]
        assert metrics["kvserve:state_checkpoint_hits_total"] > 0
    if "speculative_config" in options:
        assert metrics["kvserve:spec_decode_num_draft_tokens_total"] > 0
