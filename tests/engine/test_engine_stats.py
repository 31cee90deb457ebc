"""The engine's stats() from each part's counts: a hybrid model's state slots and checkpoints are listed (held,
free, checkpoints saved, admissions resumed from one), and a model without a state cache lists none of them."""
from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.model.test_qwen3_next import make_hybrid_model, random_prompt

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
STATE_KEYS = {"num_state_slots", "num_free_state_slots", "num_state_checkpoint_slots", "num_state_checkpoints",
              "state_checkpoint_hits"}


def test_state_slots_and_checkpoints_are_counted_as_requests_come_and_go(tmp_path):
    llm = LLM(str(make_hybrid_model(tmp_path, "qwen3_5")), kv_cache_memory="4MiB", max_model_len=256,
              max_num_seqs=4)
    engine = llm.engine
    before = engine.stats()
    assert {key: before[key] for key in STATE_KEYS} == {
        "num_state_slots": 4, "num_free_state_slots": 4, "num_state_checkpoint_slots": 4,
        "num_state_checkpoints": 0, "state_checkpoint_hits": 0}
    first = random_prompt(40, seed=1)
    engine.add_request("a", first, GREEDY)
    engine.add_request("b", random_prompt(40, seed=2), GREEDY)
    engine.step()
    assert engine.stats()["num_free_state_slots"] == 2  # one slot per running sequence
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    assert after["num_free_state_slots"] == 4 and after["state_checkpoint_hits"] == 0
    assert after["num_state_checkpoints"] == len(engine.kv.checkpoints) >= 2  # each prompt's last usable boundary
    llm.generate({"prompt_token_ids": first + random_prompt(20, seed=3)}, GREEDY)  # resumes from a's checkpoint
    assert engine.stats()["state_checkpoint_hits"] == 1


def test_without_prefix_caching_there_are_slots_but_no_checkpoints(tmp_path):
    llm = LLM(str(make_hybrid_model(tmp_path, "qwen3_next")), kv_cache_memory="4MiB", max_model_len=256,
              max_num_seqs=2, enable_prefix_caching=False)
    stats = llm.engine.stats()
    assert stats["num_state_slots"] == 2 and stats["num_state_checkpoint_slots"] == 0
    assert stats["num_state_checkpoints"] == 0 and stats["state_checkpoint_hits"] == 0


def test_a_model_without_a_state_cache_lists_no_state_keys(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path)), kv_cache_memory="1MiB", max_model_len=128)
    assert not STATE_KEYS & llm.engine.stats().keys()
