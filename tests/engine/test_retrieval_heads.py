"""Retrieval heads for `--kv-eviction headkv-span`: the weights average 1 and favour the heads that score, a head
scores where its strongest attention lands on the token being copied, the scores are measured once per model and
read back (a damaged, foreign or other-shaped file is measured again), and an engine under the policy compresses
each stream to its weighted share and gives every block back."""
import json
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine import retrieval_heads
from kvserve.engine.retrieval_heads import (DIRECTORY_NAME, METHOD, SLOPE, add_hits, copied_tokens, head_weights,
                                            load_or_measure, model_digest, retrieval_scores)
from tests.conftest import make_tiny_model, save_char_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_char_tokenizer(make_tiny_model(tmp_path_factory.mktemp("retrieval"), "llama-gqa"))


def test_weights_average_one_and_grow_with_the_square_root_of_the_score():
    scores = torch.tensor([[0.0, 0.25, 0.04], [0.0, 0.0, 1.0]])
    weights = head_weights(scores)
    assert weights.mean().item() == pytest.approx(1.0)
    raw = [[1, 1 + SLOPE * 0.5, 1 + SLOPE * 0.2], [1, 1, 1 + SLOPE]]
    torch.testing.assert_close(weights, torch.tensor(raw) / torch.tensor(raw).mean())
    assert weights[0, 0] == weights[1, 0] == weights[1, 1] == weights.min()  # heads that never copy: alike
    assert torch.equal(head_weights(torch.zeros(2, 3)), torch.ones(2, 3))  # no head copies: every head alike


def test_a_head_scores_where_its_strongest_attention_lands_on_the_copied_token():
    needle, answer = [7, 8, 9, 8], [9, 8]
    prompt = [1] * 20 + needle + [2] * 10 + answer  # the needle at 20
    copies = list(copied_tokens(prompt, 20, needle, answer))
    assert [(token, sources.tolist()) for token, _, sources in copies] == [(9, [22]), (8, [21, 23])]
    T, rows = len(prompt), retrieval_heads.ROWS
    assert [row for _, row, _ in copies] == [T - 3 - (T - rows), T - 2 - (T - rows)]  # the rows that predict them
    attention = torch.zeros(3, rows, T)
    for _, row, sources in copies:
        attention[0, row, sources[-1]] = 1.0  # head 0 looks at the copied token
        attention[1, row, 5] = 1.0  # head 1 at filler
    attention[2, copies[0][1], 22] = 1.0  # head 2 finds the first token only
    hits = torch.zeros(1, 3)
    assert add_hits(hits, {0: attention}, copies) == 2
    assert hits.tolist() == [[2.0, 0.0, 1.0]]


def test_scores_are_measured_once_kept_and_measured_again_when_the_file_is_not_to_be_trusted(model_dir, tmp_path,
                                                                                              monkeypatch):
    calls = []
    measured = torch.tensor([[0.0, 0.3], [0.2, 0.0]])
    monkeypatch.setattr(retrieval_heads, "retrieval_scores", lambda path: calls.append(path) or measured)
    scores, source = load_or_measure(model_dir, 2, 2, tmp_path)
    assert torch.equal(scores, measured) and "measured now" in source and len(calls) == 1
    path = tmp_path / DIRECTORY_NAME / f"{model_digest(model_dir)}-m{METHOD}.json"
    assert json.loads(path.read_text())["scores"] == measured.tolist()
    assert os.stat(path).st_mode & 0o077 == 0
    scores, source = load_or_measure(model_dir, 2, 2, tmp_path)
    assert torch.equal(scores, measured) and "measured before" in source and len(calls) == 1
    for damage in ("{not json", json.dumps({"method": METHOD, "scores": [[0.5]]}),
                   json.dumps({"method": METHOD, "scores": [[2.0, 0.0], [0.0, 0.0]]}),
                   json.dumps({"method": METHOD + 1, "scores": measured.tolist()})):
        path.write_text(damage)
        assert torch.equal(load_or_measure(model_dir, 2, 2, tmp_path)[0], measured)
    assert len(calls) == 5
    os.chmod(path, 0o666)  # another user may have written it
    load_or_measure(model_dir, 2, 2, tmp_path)
    assert len(calls) == 6 and os.stat(path).st_mode & 0o077 == 0


def test_scores_of_a_model_are_one_per_kv_head_and_repeat(model_dir):
    first = retrieval_scores(model_dir, samples=2, prompt_tokens=300)
    assert first.shape == (2, 2) and bool(((first >= 0) & (first <= 1)).all())
    assert torch.equal(first, retrieval_scores(model_dir, samples=2, prompt_tokens=300))


def test_a_model_without_a_tokenizer_is_refused_by_name(tmp_path):
    bare = make_tiny_model(tmp_path / "bare", "llama-gqa")
    with pytest.raises(ValueError, match="needs its tokenizer.*perhead-span"):
        retrieval_scores(bare, samples=1, prompt_tokens=100)


def test_the_engine_keeps_each_heads_weighted_share_and_gives_every_block_back(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    path = tmp_path / DIRECTORY_NAME / f"{model_digest(model_dir)}-m{METHOD}.json"
    path.parent.mkdir(mode=0o700)
    path.write_text(json.dumps({"method": METHOD, "scores": [[0.0, 0.9], [0.0, 0.0]]}))
    budget = 48
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256, max_num_batched_tokens=32,
              kv_eviction="headkv-span", kv_sink_tokens=4, kv_recent_tokens=4, kv_budget_tokens=budget)
    manager = llm.engine.kv.groups[0]
    assert manager.head_weights.tolist() == head_weights(torch.tensor([[0.0, 0.9], [0.0, 0.0]])).tolist()
    tokens = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    lengths = []
    compact = type(manager)._compact

    def seen(self, streams, keep):
        compact(self, streams, keep)
        lengths.append(streams.lengths.clone())

    monkeypatch.setattr(type(manager), "_compact", seen)
    out = llm.generate(tokens, SamplingParams(max_tokens=1, prompt_logprobs=-1))[0]
    assert bool(out.prompt_logprobs[1:].isfinite().all())
    assert lengths and torch.equal(lengths[-1], (manager.head_weights * budget).floor().long())
    stats = llm.stats()
    assert stats["num_evicted_blocks"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_budget_too_small_for_the_smallest_share_is_refused_by_name(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    path = tmp_path / DIRECTORY_NAME / f"{model_digest(model_dir)}-m{METHOD}.json"
    path.parent.mkdir(mode=0o700)
    path.write_text(json.dumps({"method": METHOD, "scores": [[0.0, 0.9], [0.0, 0.0]]}))  # the others 0.51x
    with pytest.raises(ValueError, match=r"kv_budget_tokens=48 gives the head with the smallest share \(0.51x\).*"
                                         r"\(the sinks, the recent window and the block being filled: 28\); give at "
                                         r"least 55 tokens"):
        LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=256, kv_eviction="headkv-span",
            kv_sink_tokens=4, kv_recent_tokens=8, kv_budget_tokens=48)
