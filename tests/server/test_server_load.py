"""32 concurrent streaming clients, a quarter of them hanging up after two chunks: everyone else gets exactly the
offline output, the leavers' requests are aborted rather than run on, and afterwards no KV block is in use.
Tiny random model with SmolLM2's tokenizer, as in test_server_api.py."""
import asyncio
import time

import pytest
from openai import AsyncOpenAI

from kvserve import LLM, LLMEngine, EngineConfig, SamplingParams
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model, scrape_metrics

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024)
NUM_CLIENTS, MAX_TOKENS, LEAVER_MAX_TOKENS = 32, 12, 900


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("load") / "tiny-chat")


def scrape(server: ServerThread) -> dict[str, float]:
    return scrape_metrics(server.url, "tiny-chat")


async def stay(client: AsyncOpenAI, prompt: str) -> tuple[str, str]:
    stream = await client.completions.create(model="tiny-chat", prompt=prompt, stream=True, temperature=0,
                                             max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    text, reason = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


async def leave(client: AsyncOpenAI, prompt: str) -> None:
    stream = await client.completions.create(model="tiny-chat", prompt=prompt, stream=True, temperature=0,
                                             max_tokens=LEAVER_MAX_TOKENS, extra_body={"ignore_eos": True})
    num_chunks = 0
    async for _ in stream:
        num_chunks += 1
        if num_chunks == 2:
            break
    await stream.close()


async def run_clients(url: str, prompts: list[str], leavers: set[int]) -> list:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    async with client:
        return await asyncio.gather(*(leave(client, p) if i in leavers else stay(client, p)
                                      for i, p in enumerate(prompts)))


def test_concurrent_streams_with_disconnects(model_dir):
    prompts = [f"Client {i} wants to know about paged attention" for i in range(NUM_CLIENTS)]
    leavers = set(range(3, NUM_CLIENTS, 4))
    stayers = [i for i in range(NUM_CLIENTS) if i not in leavers]
    expected = LLM(str(model_dir), **ENGINE_OPTIONS).generate(
        [prompts[i] for i in stayers], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_OPTIONS))
    with ServerThread(build_app(engine)) as server:
        results = asyncio.run(run_clients(server.url, prompts, leavers))
        assert [results[i] for i in stayers] == [(o.outputs[0].text, "length") for o in expected]
        deadline = time.monotonic() + 5
        while (after := scrape(server))["kvserve:num_used_blocks"] != 0:
            assert time.monotonic() < deadline, "blocks still in use after every client is done"
            time.sleep(0.02)
    assert after["kvserve:kv_cache_usage_perc"] == 0
    assert after["kvserve:num_requests_running"] == after["kvserve:num_requests_waiting"] == 0
    assert after['kvserve:request_success_total{finished_reason="abort"}'] == len(leavers)
    assert after['kvserve:request_success_total{finished_reason="length"}'] == len(stayers)
    # the leavers stopped where they hung up, far short of the tokens they asked for
    assert after["kvserve:generation_tokens_total"] < len(stayers) * MAX_TOKENS + len(leavers) * 100
