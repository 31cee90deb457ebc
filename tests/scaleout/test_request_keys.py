"""The router's routing keys for an HTTP request are exactly the keys of the blocks the replica's engine caches for
it: same chat template, special tokens, cache_salt and storage format. Checked against a real server's pool."""
import dataclasses
import json

import httpx
import pytest
from transformers import AutoTokenizer

from kvserve import EngineConfig, LLMEngine
from kvserve.scaleout.prefix_index import unpack_keys
from kvserve.scaleout.published_blocks import PublishedBlocks
from kvserve.scaleout.request_keys import CHAT_PATH, COMPLETIONS_PATH, RequestKeys
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model

CONFIG = EngineConfig(kv_cache_memory="64MiB", max_model_len=1024)
LONG_TEXT = "the quick brown fox jumps over the lazy dog and keeps on running far away " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("keys") / "tiny-chat")


@pytest.fixture
def served(model_dir):
    """(server url, the engine's published block keys, the router-side key function) for one fresh engine."""
    engine = LLMEngine(dataclasses.replace(CONFIG, model=str(model_dir)))
    published = PublishedBlocks(engine.kv.pool)
    with ServerThread(build_app(engine)) as server:
        yield server.url, published, RequestKeys(engine.tokenizer, CONFIG)


BODIES = {
    "text prompt": (COMPLETIONS_PATH, {"prompt": LONG_TEXT, "max_tokens": 1}),
    "token ids": (COMPLETIONS_PATH, {"prompt": list(range(100, 180)), "max_tokens": 1}),
    "salted text": (COMPLETIONS_PATH, {"prompt": LONG_TEXT, "max_tokens": 1, "cache_salt": "tenant-a"}),
    "chat": (CHAT_PATH, {"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": LONG_TEXT}], "max_tokens": 1}),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_router_keys_are_the_blocks_the_engine_caches(served, case):
    url, published, request_keys = served
    path, body = BODIES[case]
    raw = json.dumps(body).encode()
    keys = request_keys.keys(path, raw)
    response = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert len(keys) == prompt_tokens // CONFIG.block_size > 2
    assert set(keys) <= unpack_keys(published.snapshot())


def test_a_salt_or_another_storage_format_changes_every_key(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = RequestKeys(tokenizer, CONFIG).keys(COMPLETIONS_PATH, _body())
    salted = RequestKeys(tokenizer, CONFIG).keys(COMPLETIONS_PATH, _body(cache_salt="x"))
    int8 = RequestKeys(tokenizer, EngineConfig(kv_cache_dtype="int8")).keys(COMPLETIONS_PATH, _body())
    assert plain and not set(plain) & set(salted) and not set(plain) & set(int8)


@pytest.mark.parametrize("path, raw", [
    (COMPLETIONS_PATH, b"not json"),
    (COMPLETIONS_PATH, b'{"prompt": ""}'),
    (CHAT_PATH, b'{"messages": "hello"}'),
    ("/v1/models", b""),
])
def test_requests_the_replica_will_refuse_or_without_a_prompt_have_no_keys(model_dir, path, raw):
    assert RequestKeys(AutoTokenizer.from_pretrained(model_dir), CONFIG).keys(path, raw) == ()


def _body(**extra) -> bytes:
    return json.dumps({"prompt": LONG_TEXT, **extra}).encode()
