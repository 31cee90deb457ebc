"""Hybrid models (Qwen3.5 / Qwen3-Next) with the disk tier and state checkpoints: a restarted engine resumes a
returning conversation from the deepest checkpoint on disk whose blocks and state both read, with transformers'
logits, also when the writer was behind and wrote its checkpoints late; a checkpoint whose earlier blocks are
missing is never used, nor one whose KV blocks the pool evicted (poisoned, it would show); another model never finds
the records; `cached_tokens` is exactly the tokens the model did not run; no state slot or checkpoint is left
waiting after preemptions and aborts."""
from kvserve import LLM, EngineConfig, LLMEngine, SamplingParams
from kvserve.kv import resume
from kvserve.kv.block_hash import hash_full_blocks
from kvserve.kv.state_cache import StateShape
from kvserve.kv.tiers.record import STATE
from tests.engine.test_disk_tier import behind_writer
from tests.model.test_qwen3_next import (GREEDY, assert_matches, assert_nothing_held, make_hybrid_model,
                                         random_prompt, recording, reference)


def engine(path, disk_dir, **options) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": "4MiB", "max_model_len": 256, "max_num_seqs": 4,
                             "kv_disk_cache": str(disk_dir), **options})


def first_turn(path, disk_dir) -> tuple[list[int], list[int]]:
    """A first turn of 40 prompt tokens and 20 generated, written to disk: 3 full blocks (59 tokens computed),
    checkpoints after block 2 (the prompt's last boundary a hit may use, 32) and block 3 (decoding, 48). Returns
    the second turn's prompt (the first's prompt and answer, then 10 new tokens) and its block keys."""
    llm = engine(path, disk_dir)
    first = random_prompt(40, seed=7)
    answer = llm.generate({"prompt_token_ids": first}, GREEDY)[0].outputs[0].token_ids
    assert llm.engine.disk_cache.store.flush(10)
    second = first + answer + random_prompt(10, seed=8)
    return second, hash_full_blocks(second[:64], 16, namespace=llm.engine.config.kv_cache_format)


def counting_tokens(llm: LLM) -> list[int]:
    """The number of tokens each forward pass of llm's model runs (filled while it generates)."""
    counts: list[int] = []
    forward = llm.engine.model.forward
    llm.engine.model.forward = lambda input_ids, *args: counts.append(len(input_ids)) or forward(input_ids, *args)
    return counts


def test_a_restarted_engine_resumes_from_the_deepest_checkpoint_on_disk(tmp_path):
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    second, _ = first_turn(path, tmp_path / "disk")
    llm = engine(path, tmp_path / "disk")
    assert llm.engine.disk_cache.store.num_states_at_start == 2
    sampled, counts = recording(llm), counting_tokens(llm)
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert (turn2.num_cached_tokens, turn2.num_disk_cached_tokens) == (48, 48)
    # cached_tokens is exactly what was skipped: the model ran the rest of the prompt and one token per decode step
    assert sum(counts) == len(second) - 48 + GREEDY.max_tokens - 1
    logits, generated = reference(path, second)
    assert_matches(logits, generated, second, turn2.outputs[0].token_ids, sampled[turn2.request_id])
    stats = llm.stats()
    assert stats["disk_cache_reads"] == 3 + 1 and stats["state_checkpoint_hits"] == 1  # 3 blocks, 1 state
    assert_nothing_held(llm.engine)


def test_checkpoints_skipped_while_the_writer_was_behind_are_written_later(tmp_path, monkeypatch):
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    llm = engine(path, tmp_path / "disk")
    gate = behind_writer(llm, monkeypatch)  # two records queued at a time, writes held
    first = random_prompt(40, seed=7)
    answer = llm.generate({"prompt_token_ids": first}, GREEDY)[0].outputs[0].token_ids
    skipped = llm.stats()["disk_cache_writes_skipped"]
    assert skipped >= 2  # among them both state checkpoints: each came after the two queued blocks
    gate.set()
    assert llm.engine.disk_cache.flush(10)  # what a clean exit does: hands the skipped records again
    assert llm.stats()["disk_cache_writes_retried"] == skipped
    second = first + answer + random_prompt(10, seed=8)
    again = engine(path, tmp_path / "disk")
    assert again.engine.disk_cache.store.num_states_at_start == 2
    turn2 = again.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert (turn2.num_cached_tokens, turn2.num_disk_cached_tokens) == (48, 48)  # the deepest checkpoint, block 3
    assert_nothing_held(again.engine)


def test_a_damaged_deepest_state_falls_back_to_the_one_before(tmp_path):
    path = make_hybrid_model(tmp_path / "model", "qwen3_next")
    second, keys = first_turn(path, tmp_path / "disk")
    llm = engine(path, tmp_path / "disk")
    state_file = llm.engine.disk_cache.store.path(keys[2], STATE)
    data = bytearray(state_file.read_bytes())
    data[-1] ^= 0xFF  # the recurrent state's last byte: the checksum fails
    state_file.write_bytes(bytes(data))
    sampled = recording(llm)
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == 32 and llm.stats()["disk_cache_errors_corrupt"] == 1
    logits, generated = reference(path, second)
    assert_matches(logits, generated, second, turn2.outputs[0].token_ids, sampled[turn2.request_id])


def test_blocks_in_the_pool_resume_with_a_state_read_from_disk(tmp_path):
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    llm = engine(path, tmp_path / "disk")
    first = random_prompt(40, seed=7)
    answer = llm.generate({"prompt_token_ids": first}, GREEDY)[0].outputs[0].token_ids
    assert llm.engine.disk_cache.store.flush(10)
    kv = llm.engine.kv
    for key in hash_full_blocks(first + answer, 16, namespace=llm.engine.config.kv_cache_format):
        kv.checkpoints.release(key)  # gone from memory (as if evicted), still on disk
    second = first + answer + random_prompt(10, seed=8)
    sampled = recording(llm)
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == 48 and llm.stats()["disk_cache_reads"] == 1  # the state only
    logits, generated = reference(path, second)
    assert_matches(logits, generated, second, turn2.outputs[0].token_ids, sampled[turn2.request_id])


def test_a_checkpoint_whose_earlier_blocks_are_missing_is_never_used(tmp_path):
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    second, keys = first_turn(path, tmp_path / "disk")
    llm = engine(path, tmp_path / "disk")
    llm.engine.disk_cache.store.path(keys[1]).unlink()  # block 2 of 3: both states on disk lie past it
    counts = counting_tokens(llm)
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == 0 and sum(counts) == len(second) + GREEDY.max_tokens - 1
    assert turn2.outputs[0].token_ids == reference(path, second)[1]
    assert llm.stats()["state_checkpoint_hits"] == 0


def test_another_model_never_finds_the_records(tmp_path):
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    second, _ = first_turn(path, tmp_path / "disk")
    other = make_hybrid_model(tmp_path / "other", "qwen3_5", linear_value_head_dim=16)  # wider states
    llm = engine(other, tmp_path / "disk")
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == 0 and llm.stats()["disk_cache_reads"] == 0
    assert turn2.outputs[0].token_ids == reference(other, second)[1]


def test_records_of_another_state_layout_are_never_read(tmp_path, monkeypatch):
    """A checkpoint's bytes mean what the slots' layout says (kv/state_cache.py, StateShape): records written under
    another layout (an earlier version's, same sizes) belong to another fingerprint."""
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    second, _ = first_turn(path, tmp_path / "disk")
    monkeypatch.setattr(StateShape, "describe", lambda self: "conv tail [conv_dim, kernel - 1]; recurrent state "
                        "[value heads, key dim, value dim]; float32")
    llm = engine(path, tmp_path / "disk")
    assert llm.engine.disk_cache.store.num_states_at_start == 0
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_disk_cached_tokens == 0 and llm.stats()["disk_cache_reads"] == 0
    monkeypatch.undo()  # the records' own layout: read again
    assert engine(path, tmp_path / "disk").engine.disk_cache.store.num_states_at_start == 2


def test_a_checkpoint_whose_blocks_the_pool_evicted_goes_first_and_is_never_used(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_5")
    plan = LLM(str(path), kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=4).engine.cache_plan
    # 8 blocks of KV: another prompt of 100 tokens takes 7, evicting the first prompt's blocks after its first
    llm = LLM(str(path), kv_cache_memory=plan.state.total_bytes + 8 * plan.block_bytes, max_model_len=128,
              max_num_seqs=4)
    kv, cache = llm.engine.kv, llm.engine.runner.state_cache
    prompt = random_prompt(40, seed=9)
    llm.generate({"prompt_token_ids": prompt}, GREEDY)
    keys = hash_full_blocks(prompt + [0] * 8, 16, namespace=llm.engine.config.kv_cache_format)
    llm.generate({"prompt_token_ids": random_prompt(100, seed=10)}, SamplingParams(max_tokens=1))
    assert kv.checkpoints.contains(keys[1]) and kv.pool.lookup(keys[1]) is None  # kept; its KV block is not
    assert kv.checkpoints.victim() == keys[1]  # worthless: the first to go
    cache.recurrent[:, kv.checkpoints.lookup(keys[1])] = float("nan")  # used, it would poison the output
    sampled = recording(llm)
    output = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert output.num_cached_tokens == 0 and kv.checkpoints.num_hits == 0
    logits, generated = reference(path, prompt)
    assert_matches(logits, generated, prompt, output.outputs[0].token_ids, sampled[output.request_id])


def test_preemptions_and_aborts_leave_no_slot_held_nor_checkpoint_waiting(tmp_path):
    path = make_hybrid_model(tmp_path / "model", "qwen3_next")
    plan = LLM(str(path), kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=4).engine.cache_plan
    engine_ = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=plan.state.total_bytes + 12 * plan.block_bytes,
                                     max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24,
                                     kv_disk_cache=str(tmp_path / "disk")))
    for i in range(6):
        engine_.add_request(f"r{i}", random_prompt(40 + i, seed=20 + i), GREEDY)
    for step in range(40):
        engine_.step()
        if step in (5, 12):  # mid-prefill and mid-decode
            engine_.abort_request(f"r{step % 6}")
    while engine_.has_unfinished_requests():
        engine_.step()
    assert engine_.scheduler.num_preemptions > 0
    assert engine_.kv.checkpoints.num_waiting == 0 and len(engine_.kv.checkpoints) <= engine_.kv.checkpoints.num_slots
    assert_nothing_held(engine_)


def test_a_branch_point_goes_to_disk_and_interval_checkpoints_stay_in_memory(tmp_path, monkeypatch):
    # interval 32: the first 70-token prompt saves its state at 32 (interval) and 64 (its end), the second, sharing
    # 50 tokens (3 blocks), resumes at 32 and saves its state at 48 (a branch point) and 64 (its end). Only the
    # prompts' ends and the branch point are written; after a restart the third prompt resumes at the branch point
    monkeypatch.setattr(resume, "CHECKPOINT_INTERVAL_TOKENS", 32)
    path = make_hybrid_model(tmp_path / "model", "qwen3_next")
    llm = engine(path, tmp_path / "disk")
    shared = random_prompt(50, seed=11)
    prompts = [shared + random_prompt(20 + i, seed=12 + i) for i in range(3)]
    outputs = [llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))[0] for prompt in prompts[:2]]
    assert [o.num_cached_tokens for o in outputs] == [0, 32]
    assert llm.engine.disk_cache.store.flush(10)
    llm = engine(path, tmp_path / "disk")
    assert llm.engine.disk_cache.store.num_states_at_start == 3
    sampled = recording(llm)
    output = llm.generate({"prompt_token_ids": prompts[2]}, GREEDY)[0]
    assert (output.num_cached_tokens, output.num_disk_cached_tokens) == (48, 48)
    logits, generated = reference(path, prompts[2])
    assert_matches(logits, generated, prompts[2], output.outputs[0].token_ids, sampled[output.request_id])
    assert_nothing_held(llm.engine)
