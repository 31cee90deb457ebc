"""A mixed load: requests arriving while others run, most sharing one of a few prefixes, some with n = 2, greedy and
seeded samples, a few aborted mid-way, with prompt-lookup speculation, in a pool small enough to preempt. Every
request that finishes gives the text it gives alone on an engine without pressure, speculation or prefix caching,
and afterwards no block or state slot is held. On hybrid models (Gated DeltaNet layers beside full attention: state
slots and checkpoints beside the blocks) and on Gemma 3 (a sliding and a full-attention layer group: a prefix hit
holds cached blocks in both).

The tiny models have a 32-token vocabulary: their text falls into loops, so prompt lookup drafts often, both tokens
the model goes on to produce and tokens it does not."""
import random

import pytest

from kvserve import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.conftest import make_tiny_model
from tests.model.test_qwen3_next import make_hybrid_model

VOCAB = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
NUM_REQUESTS = 16


def workload(rng: random.Random) -> list[tuple[str, list[int], SamplingParams]]:
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.75 else []
        prompt += [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        seeded = rng.random() < 0.5
        params = SamplingParams(n=2 if rng.random() < 0.25 else 1, max_tokens=rng.randint(1, 24),
                                temperature=0.8 if seeded else 0, seed=i if seeded else None, ignore_eos=True)
        requests.append((f"r{i}", prompt, params))
    return requests


def run_mixed(engine: LLMEngine, requests, aborted: set[str], rng: random.Random) -> tuple[dict, int]:
    """Requests added one at a time between steps, the `aborted` ones aborted a few steps after they arrive; returns
    the finished requests' texts and their cached prompt tokens."""
    pending, texts, cached, arrived = list(requests), {}, 0, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
            arrived[request_id] = step
        for output in engine.step() if engine.has_unfinished_requests() else []:
            if output.finished:
                texts[output.request_id] = [c.token_ids for c in output.outputs]
                cached += output.num_cached_tokens
        for request_id in aborted:
            if arrived.get(request_id) == step - 3 and request_id not in texts:
                engine.abort_request(request_id)
        step += 1
    return texts, cached


def make_model(directory, kind: str) -> str:
    if kind.startswith("qwen3"):
        return str(make_hybrid_model(directory, kind, vocab_size=VOCAB, initializer_range=0.02))
    return str(make_tiny_model(directory, kind, vocab_size=VOCAB, initializer_range=0.02))


# (model, workload seed, prompt tokens a step, KV blocks): each preempts, hits prefixes and accepts drafts
CASES = [("qwen3_5", 2, 24, 14), ("qwen3_next", 0, 40, 14), ("gemma3-mqa", 0, 24, 16), ("gemma3-mqa", 2, 40, 18)]


@pytest.mark.parametrize("kind,seed,chunk,num_blocks", CASES)
def test_every_finished_request_gives_its_text_alone_and_nothing_is_held(tmp_path, kind, seed, chunk, num_blocks):
    path = make_model(tmp_path, kind)
    rng = random.Random(seed)
    requests = workload(rng)
    aborted = set(rng.sample([r[0] for r in requests], 3))

    alone = LLM(path, kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    expected = {request_id: [c.token_ids for c in alone.generate([{"prompt_token_ids": prompt}], params)[0].outputs]
                for request_id, prompt, params in requests}

    plan = LLM(path, kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=4).engine.cache_plan
    states = plan.state.total_bytes if plan.state is not None else 0
    small = states + num_blocks * plan.block_bytes  # for 4 sequences of up to ~110 tokens: they preempt
    engine = LLMEngine(EngineConfig(model=path, kv_cache_memory=small, max_model_len=128, max_num_seqs=4,
                                    max_num_batched_tokens=chunk, speculative_config=NGRAM))
    texts, cached = run_mixed(engine, requests, aborted, rng)

    finished = [r[0] for r in requests if r[0] in texts]
    assert len(finished) >= NUM_REQUESTS - len(aborted)
    assert {request_id: texts[request_id] for request_id in finished} == \
        {request_id: expected[request_id] for request_id in finished}
    assert engine.scheduler.num_preemptions > 0
    assert cached > 0  # prefix hits (on hybrids, resumed from state checkpoints)
    drafts = engine.speculator.stats
    assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens  # drafts accepted and rejected
    assert engine.kv.pool.num_free_blocks == engine.cache_plan.num_blocks
    assert engine.kv.state is None or engine.kv.state.num_free_slots == engine.kv.state.num_slots
