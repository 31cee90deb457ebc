"""How the runner groups a step's decodes for attention: one call per layer group where the cache reads blocks in
place (float32 on a CPU with --compile-decode), buckets of alike context lengths where attention reads a padded
copy; and the reader it attends with: the format's, wrapped once at start by an eviction policy that scores."""
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner
from kvserve.kv.readers import DecodeKernelReader, GatherReader
from kvserve.kv.scored_attention import H2OScoredReader, SinkScoredReader
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


@pytest.mark.parametrize("options, reader, inner", [
    (dict(), GatherReader, None),
    (dict(kv_cache_dtype="int8"), DecodeKernelReader, None),
    (dict(kv_eviction="streaming", kv_recent_tokens=64), SinkScoredReader, GatherReader),
    (dict(kv_cache_dtype="int8", kv_eviction="h2o", kv_recent_tokens=32, kv_budget_tokens=96), H2OScoredReader,
     DecodeKernelReader),
])
def test_the_runner_attends_with_the_formats_reader_as_the_eviction_policy_wrapped_it(model_dir, options, reader,
                                                                                       inner):
    engine = LLM(str(model_dir), kv_cache_memory="4MiB", max_model_len=512, **options).engine
    assert type(engine.cache.reader) is reader
    if inner is not None:
        assert type(engine.cache.reader.reader) is inner and engine.cache.reader.reader.cache is engine.cache
    if reader is H2OScoredReader:
        assert engine.cache.reader.scores is engine.scores
