"""The roofline's FLOP count is the model's linear and head shapes times the tokens each step sends through them,
and the replayed rate comes from real matmuls of those shapes."""
from collections import Counter

from kvserve.bench.roofline import (MatmulShapes, decode_steps, matmul_seconds, read_bandwidth, replayed_seconds,
                                    share_ceiling, step_seconds, workload_flops)
from kvserve.model.config import ModelConfig

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def test_flops_count_every_linear_once_per_token_and_the_head_per_sampled_row():
    shapes = MatmulShapes.of(ModelConfig.from_hf(SMOLLM2))
    layer_params = 576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576
    assert shapes.flops(1, 0) == 2 * 30 * layer_params
    assert shapes.flops(10, 3) == 10 * shapes.flops(1, 0) + 3 * 2 * 49152 * 576
    assert workload_flops(shapes, Counter({(10, 3): 2, (1, 1): 5})) == 2 * shapes.flops(10, 3) + 5 * shapes.flops(1, 1)


def test_each_step_shape_is_timed_once_and_a_workload_is_their_sum():
    tiny = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)
    steps = Counter({(8, 2): 3, (2, 2): 1})
    per_step = step_seconds(MatmulShapes.of(ModelConfig.from_hf(tiny)), steps)
    assert set(per_step) == {(8, 2), (2, 2)} and all(0 < t < 1 for t in per_step.values())
    assert replayed_seconds(per_step, steps) == 3 * per_step[8, 2] + per_step[2, 2]
    assert replayed_seconds(per_step, Counter({(2, 2): 5})) == 5 * per_step[2, 2]


def test_share_ceilings_count_the_kv_read_and_prompt_steps_as_they_ran():
    # 10 s of matmuls, 4 of them the decode steps', 2 s to read their K/V: 10 / 12 with prompts at their matmuls
    assert share_ceiling(10.0, 4.0, 2.0) == 10 / 12
    # prompt steps that took 9 s (their matmuls 6): 10 / (9 + 4 + 2)
    assert share_ceiling(10.0, 4.0, 2.0, prompt_seconds=9.0) == 10 / 15


def test_decode_steps_are_the_steps_whose_every_token_is_sampled():
    steps = Counter({(8, 1): 1, (4, 4): 5, (1, 1): 7, (6, 2): 1})
    assert decode_steps(steps) == Counter({(4, 4): 5, (1, 1): 7})


def test_replayed_seconds_are_a_positive_time():
    tiny = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)
    shapes = MatmulShapes.of(ModelConfig.from_hf(tiny))
    assert 0 < matmul_seconds(shapes, Counter({(1, 1): 3})) < 1


def test_read_bandwidth_is_bytes_over_the_time_a_sum_takes(monkeypatch):
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.5])  # three sums: 0.5 s, 0.25 s, 0.5 s; the best counts
    monkeypatch.setattr("kvserve.bench.roofline.time.perf_counter", lambda: next(ticks))
    assert read_bandwidth.__wrapped__(2**20, reps=3) == 2**20 / 0.25
