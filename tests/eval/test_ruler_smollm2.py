"""RULER-lite on the embedded SmolLM2 at 512 tokens, through the engine: the full cache gets a score for every task,
and a StreamingLLM window too small to hold any needle (4 sinks + 64 recent tokens) finds none of the 7-digit
values the full cache finds."""
import json

import pytest

from kvserve.cli import main
from kvserve.eval.ruler import TASKS, make_samples
from kvserve.model.loader import resolve_model


@pytest.mark.slow
def test_full_cache_finds_needles_a_tiny_streaming_window_cannot_see(capsys):
    assert main(["eval", "--tasks", "ruler", "--ruler-lengths", "512", "--ruler-samples", "2",
                 "--setting", "kv_eviction=none", "--setting", "kv_eviction=streaming,kv_recent_tokens=64",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--json"]) == 0
    full, streaming = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert full["ruler"]["512"].keys() == streaming["ruler"]["512"].keys() == set(TASKS)
    assert streaming["max_tokens_per_sequence"] < 128  # both needles sit further than that from the question
    needles = ("niah_single", "niah_multikey")
    assert sum(full["ruler"]["512"][task] for task in needles) > 0
    assert all(streaming["ruler"]["512"][task] == 0 for task in needles)


@pytest.mark.slow
def test_prompts_in_the_model_tokenizer_land_just_under_the_length():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    for task in TASKS:
        for sample in make_samples(tokenizer, task, 2048, 3, seed=0):
            assert 2048 - 8 <= len(sample.token_ids) <= 2048
