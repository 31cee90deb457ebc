"""How the runner groups a step's decodes for attention: one call per layer group where the cache reads blocks in
place (float32 on a CPU with --compile-decode), buckets of alike context lengths where attention reads a padded
copy."""
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def decode_calls(model_dir, monkeypatch, **options) -> list[int]:
    """Attention calls of each decode-only step, prompts of 5, 60 and 200 tokens decoded together."""
    calls, build = [], ModelRunner.build_batch

    def recording(self, out):
        input_ids, meta, chunks = build(self, out)
        if all(c.num_tokens == 1 for c in chunks) and len(chunks) == 3:
            calls.append(len(meta.groups[0]))
        return input_ids, meta, chunks

    monkeypatch.setattr(ModelRunner, "build_batch", recording)
    llm = LLM(str(model_dir), kv_cache_memory="4MiB", max_model_len=512, **options)
    llm.generate([[5] * 5, [6] * 60, [7] * 200], SamplingParams(max_tokens=4, temperature=0.0))
    return calls


def test_decodes_attend_in_one_call_where_blocks_are_read_in_place(model_dir, monkeypatch):
    assert decode_calls(model_dir, monkeypatch, compile_decode=True) == [1, 1, 1]


@pytest.mark.parametrize("options", [dict(), dict(compile_decode=True, kv_cache_dtype="bfloat16"),
                                     dict(compile_decode=True, kv_eviction="streaming", kv_recent_tokens=64)])
def test_decodes_of_unlike_contexts_are_bucketed_where_attention_reads_a_padded_copy(model_dir, monkeypatch, options):
    assert decode_calls(model_dir, monkeypatch, **options) == [3, 3, 3]
