"""Scored attention (kvserve/kv/scored_attention.py): each eviction policy installs its reader around the format's
once, at start; H2O's gives the format's output and adds every query head's attention, one in all, to the slots of
the keys it read; StreamingLLM's reads groups without rotated sinks as the format does, and scores sinks by the
query it is given."""
import torch

from kvserve.kv.eviction import EvictionPolicy, H2OPolicy, StreamingPolicy
from kvserve.kv.readers import AttentionGroup, GatherReader
from kvserve.kv.scored_attention import AttentionScores, H2OScoredReader, SinkScoredReader
from tests.kv.test_readers import BLOCKS, BS, DIM, HEADS, PER_HEAD, decode_group, filled, new_tokens


def scored_group() -> AttentionGroup:
    """decode_group, with what scoring reads: each key's slot and which query rows are real."""
    group = decode_group()
    group.key_slots = (group.block_tables[:, :, None] * BS + torch.arange(BS)).flatten(1)
    group.query_valid = torch.ones(2, 1, dtype=torch.bool)
    return group


def test_each_policy_installs_its_reader_around_the_formats():
    reader = filled("float32").reader
    scores = AttentionScores(BLOCKS * BS, BS)
    assert EvictionPolicy().attention_reader(reader, None) is reader
    streaming = StreamingPolicy(sink_tokens=4, recent_tokens=8).attention_reader(reader, None)
    assert type(streaming) is SinkScoredReader and streaming.reader is reader
    h2o = H2OPolicy(sink_tokens=4, recent_tokens=8, budget_tokens=16).attention_reader(reader, scores)
    assert type(h2o) is H2OScoredReader and h2o.reader is reader and h2o.scores is scores
    assert not streaming.reads_decodes_in_place() and not h2o.reads_decodes_in_place()  # both read gathered keys


def test_h2o_attends_as_the_format_and_adds_each_query_heads_attention_to_the_keys_slots():
    cache, group = filled("float32"), scored_group()
    scores = AttentionScores(BLOCKS * BS, BS)
    q, k, v = new_tokens()
    out = H2OScoredReader(cache.reader, scores).attend(q, k, v, 0, [group], 0.25)
    assert torch.allclose(out, cache.reader.attend(q, k, v, 0, [group], 0.25), atol=1e-6)
    assert torch.isclose(scores.per_slot.sum(), torch.tensor(2.0 * HEADS * PER_HEAD))  # 2 queries, each head's 1
    assert scores.per_slot[7] == 0 and bool((scores.per_slot[:7] > 0).all())  # the first request's unseen key


def test_streaming_reads_groups_without_rotated_sinks_as_the_format_does():
    cache, group = filled("float32"), decode_group()
    q, k, v = new_tokens()
    out = SinkScoredReader(cache.reader).attend(q, k, v, 0, [group], 0.25)
    assert torch.equal(out, cache.reader.attend(q, k, v, 0, [group], 0.25))


def test_sinks_rotated_by_no_angle_score_as_the_plain_query_does():
    cache, group = filled("fp8_e4m3"), decode_group()  # stored rotated (Hadamard): queries rotated alike
    group.sink_keys = torch.tensor([[True] * 2 + [False] * 2] * 2)
    group.sink_rotation = torch.ones(2, 1, 1, DIM), torch.zeros(2, 1, 1, DIM)
    q, k, v = new_tokens()
    out = SinkScoredReader(cache.reader).attend(q, k, v, 0, [group], 0.25)
    assert torch.allclose(out, GatherReader(cache).attend(q, k, v, 0, [group], 0.25), atol=1e-5)
    group.sink_rotation = torch.zeros(2, 1, 1, DIM), torch.zeros(2, 1, 1, DIM)  # sink logits 0: weights change
    assert not torch.allclose(SinkScoredReader(cache.reader).attend(q, k, v, 0, [group], 0.25), out, atol=1e-3)
