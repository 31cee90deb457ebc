"""Multi-turn cost on a stateless chat API: the seed's 1,200 / 200 / 500 × 10 conversation."""
import pytest

from kvserve.planner.conversation import plan_conversation
from kvserve.planner.kv_size import resolve_kv_dtype
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.units import MiB


def seed_conversation(**overrides):
    spec = load_model_spec("llama-3.1-8b")
    args = {"first": 1_200, "question": 200, "answer": 500, "turns": 10, "block_size": 16, **overrides}
    return plan_conversation(spec, resolve_kv_dtype("bf16", spec), **args)


def test_after_ten_turns_the_request_holds_8000_tokens_and_1000_mib():
    conv = seed_conversation()
    assert conv.final_tokens == 8_000
    assert conv.final_kv_bytes == 1_000 * MiB


def test_without_prefix_caching_every_turn_prefills_the_whole_history():
    conv = seed_conversation()
    assert [t.prompt_tokens for t in conv.turns[:3]] == [1_200, 1_900, 2_600]
    assert conv.prefill_tokens_without_prefix_cache == 43_500
    assert conv.new_input_tokens == 3_000
    assert conv.recompute_factor == 14.5


def test_prefix_caching_prefills_new_tokens_plus_the_partial_block_tail():
    conv = seed_conversation()
    # turn 2 re-sends 1,700 cached tokens: 106 full blocks (1,696) hit, the 4-token tail is recomputed
    assert conv.turns[1].prefill_tokens_with_prefix_cache == 200 + 4
    assert conv.turns[2].prefill_tokens_with_prefix_cache == 200  # 2,400 tokens fill 150 blocks exactly
    assert conv.prefill_tokens_with_prefix_cache == 3_052


def test_kv_at_the_end_of_a_turn_is_held_in_whole_blocks():
    conv = seed_conversation()
    assert conv.turns[0].final_tokens == 1_700
    assert conv.turns[0].kv_bytes == 1_712 * 128 * 1024  # 107 blocks


@pytest.mark.parametrize("field", ["first", "question", "answer", "turns"])
def test_non_positive_sizes_are_refused(field):
    with pytest.raises(ValueError, match=f"--{field} must be at least 1"):
        seed_conversation(**{field: 0})
