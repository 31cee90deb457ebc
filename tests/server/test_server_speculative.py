"""A server with --speculative-config: the same greedy answer as without it, and vLLM's spec_decode counters in
/metrics agreeing with the engine."""
import json

import httpx

from kvserve import EngineConfig, LLMEngine
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model, scrape_metrics

BODY = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def answer(engine: LLMEngine) -> tuple[dict, dict[str, float], str]:
    """The answer, the metrics after it, and the same request's streamed text."""
    with ServerThread(build_app(engine)) as server:
        body = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).json()
        streamed = []
        with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
        return body, scrape_metrics(server.url, "tiny-chat"), "".join(streamed)


def plain_tokens(body: dict, engine: LLMEngine) -> list[int]:
    return engine.tokenizer(body["choices"][0]["text"], add_special_tokens=False).input_ids


def test_speculating_server_answers_the_same_and_counts_drafts(tmp_path):
    model_dir = make_tiny_chat_model(tmp_path / "tiny-chat")
    options = dict(model=str(model_dir), kv_cache_memory="16MiB", max_model_len=256)
    plain, _, _ = answer(LLMEngine(EngineConfig(**options)))
    engine = LLMEngine(EngineConfig(**options, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'))
    # a random model never repeats itself: propose the plain answer's tokens, every other draft wrong at its end
    reference, calls = plain_tokens(plain, engine), []

    def lookup(seq, limit):
        calls.append(limit)
        done = seq.num_output_tokens
        draft = reference[done : done + limit]
        return draft[:-1] + [(draft[-1] + 1) % 256] if draft and len(calls) % 2 else draft

    engine.speculator.lookup = lookup
    expected = plain["choices"][0]["text"]
    spec, metrics, streamed = answer(engine)
    assert spec["choices"][0]["text"] == expected == streamed and spec["usage"] == plain["usage"]
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert metrics[f"kvserve:spec_decode_{name}_total"] == stats[f"spec_decode_{name}"]
    assert metrics["kvserve:generation_tokens_total"] == 2 * 24
    assert metrics["kvserve:inter_token_latency_seconds_count"] == 2 * 23  # one gap per token after the first
