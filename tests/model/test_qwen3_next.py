"""Our Qwen3-Next / Qwen3.5 decoder (hybrid: Gated DeltaNet layers beside full attention) against transformers' on the
same random weights, float32, max abs diff <= 1e-4: every prompt position and 20 greedy decode steps, with the
prompt whole, chunked (chunks that do and do not divide the delta rule's 64), batched beside other sequences,
preempted and recomputed, forked (n = 2, beam search), decoding from slots that are and are not one run, and resumed
from a state checkpoint after a prefix hit; every block and state slot back afterwards; the settings hybrid models
do not run with yet refused by name."""
import logging

import pytest
import safetensors.torch
import torch
import transformers

from kvserve import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from kvserve.kv import resume, state_cache
from kvserve.model.qwen3_next import Qwen3NextModel
from tests.conftest import add_chat_tokenizer

NUM_DECODE_STEPS = 20
GREEDY = SamplingParams(max_tokens=NUM_DECODE_STEPS, temperature=0, ignore_eos=True)
TOLERANCE = 1e-4
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=1024,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
# Qwen3-Next: fused in-projections; Qwen3.5: split ones; both linear, linear, full, linear (two full in qwen3_5)
KINDS = {
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(num_hidden_layers=4, num_experts=0,
                        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                dict(num_hidden_layers=4,
                     layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
}


def make_hybrid_model(directory, kind: str, **overrides):
    """Save a 4-layer random hybrid model as an HF directory; norms and gates randomized so that they matter."""
    config_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(0)
    return save_randomized(model_cls(config_cls(**{**COMMON, **extra, **overrides})), directory)


def save_randomized(model, directory):
    """Norms, gates and routers of a freshly made model given random values that matter, then saved."""
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.add_(torch.randn_like(param) * 0.3)
            if name.endswith("mlp.gate.weight"):  # a router: no ties among the experts' scores
                param.add_(torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(path, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits over prompt + its greedy continuation (one pass), and that continuation, picked by
    argmax at each step (generate's min_new_tokens would mask the end-of-sequence id, which ignore_eos samples)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NUM_DECODE_STEPS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
        return hf(torch.tensor([tokens])).logits[0], tokens[len(prompt):]


def recording(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """The logits each sequence sampled from, step by step (filled while llm generates)."""
    sampled: dict[str, list[torch.Tensor]] = {}
    run = llm.engine.runner.run

    def recording_run(out):
        step = run(out)
        for row, seq in zip(step.logits, step.seqs):
            sampled.setdefault(seq.request_id, []).append(row)
        return step

    llm.engine.runner.run = recording_run
    return sampled


def assert_matches(logits: torch.Tensor, generated: list[int], prompt: list[int], tokens: list[int],
                   steps: list[torch.Tensor]) -> None:
    assert tokens == generated
    assert len(steps) == NUM_DECODE_STEPS
    for i, step in enumerate(steps):  # step i samples token i from position len(prompt) - 1 + i
        assert (step - logits[len(prompt) - 1 + i]).abs().max() <= TOLERANCE, f"prompt of {len(prompt)}, step {i}"


def assert_nothing_held(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_free_blocks == engine.cache_plan.num_blocks
    assert engine.kv.state.num_free_slots == engine.kv.state.num_slots


def engine_logits(engine: LLMEngine, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logits at every prompt position (over however many chunks the prompt took) and at each decode step, in order
    (transformers' over the prompt and the greedy tokens but the last, row for row), and the greedy tokens."""
    hidden = []
    forward = engine.model.forward
    engine.model.forward = lambda *args: hidden.append(forward(*args)) or hidden[-1]
    engine.add_request("r", prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
    rows = torch.cat(hidden)  # one sequence: the prompt's chunks, then one row per decode step
    assert len(rows) == len(prompt) + NUM_DECODE_STEPS - 1
    return engine.model.compute_logits(rows), tokens


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("chunk", [None, 16, 24])  # whole; chunks that divide 64 and that do not
def test_prompt_and_decode_logits_match_transformers(tmp_path, kind, chunk):
    path = make_hybrid_model(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4,
                                    **({"max_num_batched_tokens": chunk} if chunk else {})))
    assert isinstance(engine.model, Qwen3NextModel)
    prompt = random_prompt(70, seed=1)  # more than one 64-token block of the chunked delta rule
    ours, tokens = engine_logits(engine, prompt)
    logits, generated = reference(path, prompt)
    assert (ours - logits[: len(ours)]).abs().max() <= TOLERANCE
    assert tokens == generated
    assert_nothing_held(engine)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_batched_chunked_decodes_match_transformers(tmp_path, kind):
    path = make_hybrid_model(tmp_path, kind)
    # 24 tokens a step: the long prompts take several chunks while the others prefill and decode beside them
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=24, max_num_seqs=4)
    sampled = recording(llm)
    prompts = [random_prompt(n, seed=n) for n in (45, 1, 9, 70)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, output in zip(prompts, outputs):
        logits, generated = reference(path, prompt)
        assert_matches(logits, generated, prompt, output.outputs[0].token_ids, sampled[output.request_id])
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("compiled", [False, True])  # the states' decode update eager, or compiled at start
def test_decodes_whose_slots_are_not_one_run_match_transformers(tmp_path, monkeypatch, compiled):
    path = make_hybrid_model(tmp_path, "qwen3_next")
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4,
              **({"compile_decode": True} if compiled else {}))
    update = llm.engine.runner.state_cache.compiled_update
    assert (update is not None) == compiled
    one_row = llm.engine.model.linears.one_row  # compiled, a decode's one row is multiplied by the compiled loop too
    assert (one_row is not None and one_row.failed is None) == compiled
    eager_updates = []  # decode updates that ran eagerly
    eager = state_cache.delta_rule_step_
    monkeypatch.setattr(state_cache, "delta_rule_step_", lambda *args: eager_updates.append(1) or eager(*args))
    sampled = recording(llm)
    runs = []  # per decode step: whether its slots were one run (read and written in place)
    state_step = llm.engine.runner._state_step
    llm.engine.runner._state_step = lambda *a: (step := state_step(*a), runs.append(step.decodes.first is not None))[0]
    prompts = [random_prompt(n, seed=20 + n) for n in (12, 30, 7)]
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)  # frees the middle slot early
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [GREEDY, short, GREEDY])
    assert True in runs and False in runs  # slots 0, 1, 2 in place, then 0 and 2 through copies
    for prompt, output in zip(prompts, outputs):
        logits, generated = reference(path, prompt)
        if output is outputs[1]:
            assert output.outputs[0].token_ids == generated[:3]
            continue
        assert_matches(logits, generated, prompt, output.outputs[0].token_ids, sampled[output.request_id])
    assert_nothing_held(llm.engine)
    # compiled: both kinds of decode (in place and through copies) ran the two graphs compiled at start
    assert (len(eager_updates) == 0) == compiled and (not compiled or len(update.graphs.graphs) == 2)
    if compiled:  # one graph for every weight shape; a single stream's decodes take it, matching transformers
        loop = one_row.compiled
        assert loop.graphs_compiled + loop.graphs_loaded <= 1  # none if this process compiled it before
        taken = []
        monkeypatch.setattr(one_row, "compiled", lambda args: taken.append(loop(args)) or taken[-1])
        output = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)[0]
        logits, generated = reference(path, prompts[0])
        assert output.outputs[0].token_ids == generated and taken and all(y is not None for y in taken)


def test_preempted_sequences_recompute_to_the_same_logits(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_5")
    plan = LLM(str(path), kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=4).engine.cache_plan
    # 12 blocks of KV beside 4 state slots: 4 sequences of 60 tokens need 16 blocks, so some are preempted
    small = plan.state.total_bytes + 12 * plan.block_bytes
    llm = LLM(str(path), kv_cache_memory=small, max_model_len=128, max_num_seqs=4)
    assert llm.engine.cache_plan.num_blocks == 12
    sampled = recording(llm)
    prompts = [random_prompt(40, seed=10 + i) for i in range(4)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        logits, generated = reference(path, prompt)
        assert_matches(logits, generated, prompt, output.outputs[0].token_ids, sampled[output.request_id])
    assert_nothing_held(llm.engine)


def test_forked_samples_continue_from_a_copy_of_the_state(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_next")
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4)
    prompt = random_prompt(30, seed=5)
    params = SamplingParams(n=2, max_tokens=NUM_DECODE_STEPS, temperature=0, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params)[0]
    _, generated = reference(path, prompt)
    assert [c.token_ids for c in output.outputs] == [generated, generated]
    assert_nothing_held(llm.engine)


def test_aborted_requests_give_back_blocks_and_slots(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_5")
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=2,
                                    max_num_batched_tokens=64))
    for i in range(3):  # the third waits for a slot
        engine.add_request(f"r{i}", random_prompt(40, seed=i), GREEDY)
    engine.step()
    assert engine.kv.state.num_free_slots == 0
    for i in range(3):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    assert_nothing_held(engine)


def test_state_slots_come_out_of_the_budget_first(tmp_path, caplog):
    path = make_hybrid_model(tmp_path, "qwen3_next")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=8))
    plan = engine.cache_plan
    assert plan.state.num_slots == 8 == engine.kv.state.num_slots
    assert plan.state.num_checkpoints == 8 == engine.kv.checkpoints.num_slots  # prefix caching: as many again
    assert engine.runner.state_cache.nbytes == plan.state.total_bytes == 16 * plan.state.slot_bytes
    assert plan.num_blocks == (4 * 2**20 - plan.state.total_bytes) // plan.block_bytes
    assert "state cache: 8 slots + 8 checkpoints" in caplog.text
    plain = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=8,
                                   enable_prefix_caching=False))
    assert plain.cache_plan.state.num_checkpoints == 0 and plain.kv.checkpoints is None
    with pytest.raises(ValueError, match="state slots .* lower max_num_seqs or raise kv_cache_memory"):
        LLMEngine(EngineConfig(model=str(path), kv_cache_memory=plan.state.slot_bytes * 3, max_num_seqs=4))


def test_a_returning_conversation_resumes_from_a_state_checkpoint(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_5")
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4)
    sampled = recording(llm)
    first = random_prompt(40, seed=7)
    turn1 = llm.generate({"prompt_token_ids": first}, GREEDY)[0]
    assert turn1.num_cached_tokens == 0
    # the second turn: the first's prompt and answer, then 10 new tokens. Its KV hit covers the 3 full blocks the
    # first turn computed (59 tokens: the last sampled token is never computed), and a checkpoint was saved at 48
    # while decoding: the hit resumes there
    second = first + turn1.outputs[0].token_ids + random_prompt(10, seed=8)
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == 48
    assert llm.engine.kv.checkpoints.num_hits == 1
    logits, generated = reference(path, second)
    assert_matches(logits, generated, second, turn2.outputs[0].token_ids, sampled[turn2.request_id])
    # the same prompt again resumes at its last block boundary a hit may use (64: its last token is computed)
    again = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == generated
    assert_nothing_held(llm.engine)


def test_a_prompt_that_fills_its_last_block_keeps_the_state_at_its_end(tmp_path):
    # a 32-token prompt and a 5-token answer: no block boundary is reached while decoding, so the end of the
    # finished request's last full block is the prompt's end, saved as the prompt chunk passes it
    path = make_hybrid_model(tmp_path, "qwen3_5")
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    sampled = recording(llm)
    first = random_prompt(32, seed=9)
    turn1 = llm.generate({"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=5))[0]
    second = first + turn1.outputs[0].token_ids + random_prompt(10, seed=10)
    turn2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]
    assert turn2.num_cached_tokens == 32 and llm.engine.kv.checkpoints.num_hits == 1
    logits, generated = reference(path, second)
    assert_matches(logits, generated, second, turn2.outputs[0].token_ids, sampled[turn2.request_id])
    # the same first prompt again still resumes at its last block boundary a hit may use (16)
    again = llm.generate({"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=5))[0]
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == turn1.outputs[0].token_ids
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("kind, interval, cached", [
    # the first saves its state only at its own last boundary (64); the second finds the 3 shared blocks in the
    # pool but no state there, computes from the start and saves its state where its hit ended (48)
    ("qwen3_5", 256, [0, 0, 48]),
    # with an interval of 32 tokens the first also saves its state at 32, so the second resumes there at once
    ("qwen3_next", 32, [0, 32, 48]),
])
def test_prompts_sharing_a_prefix_resume_where_they_part(tmp_path, monkeypatch, kind, interval, cached):
    # three prompts share 50 tokens (3 full blocks) and then differ: the third resumes where the second's hit ended
    monkeypatch.setattr(resume, "CHECKPOINT_INTERVAL_TOKENS", interval)
    path = make_hybrid_model(tmp_path, kind)
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=48)
    sampled = recording(llm)
    shared = random_prompt(50, seed=11)
    prompts = [shared + random_prompt(20 + i, seed=12 + i) for i in range(3)]
    outputs = [llm.generate({"prompt_token_ids": prompt}, GREEDY)[0] for prompt in prompts]
    assert [o.num_cached_tokens for o in outputs] == cached
    assert llm.engine.kv.checkpoints.num_hits == sum(n > 0 for n in cached)
    for prompt, output in zip(prompts[1:], outputs[1:]):
        logits, generated = reference(path, prompt)
        assert_matches(logits, generated, prompt, output.outputs[0].token_ids, sampled[output.request_id])
    assert_nothing_held(llm.engine)


def test_a_checkpoint_without_its_kv_blocks_is_never_used(tmp_path):
    path = make_hybrid_model(tmp_path, "qwen3_next")
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4)
    prompt = random_prompt(40, seed=9)
    llm.generate({"prompt_token_ids": prompt}, GREEDY)
    assert len(llm.engine.kv.checkpoints) > 0
    assert llm.engine.reset_prefix_cache()  # the KV blocks leave the prefix index; the checkpoints stay
    output = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert output.num_cached_tokens == 0 and llm.engine.kv.checkpoints.num_hits == 0
    assert output.outputs[0].token_ids == reference(path, prompt)[1]


def test_beam_search_forks_the_state_and_matches_transformers(tmp_path):
    # each beam holds a state slot; forking a parent's children and dropping it right after keeps at most
    # beam_width + 1 beams alive, so 4 slots run 3 beams
    path = make_hybrid_model(tmp_path, "qwen3_5")
    prompt = random_prompt(21, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                          max_new_tokens=12, eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    llm = LLM(str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4)
    result = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))[0]
    assert [h.token_ids for h in result.sequences] == out.sequences[:, len(prompt):].tolist()
    assert [h.score for h in result.sequences] == pytest.approx(out.sequences_scores.tolist(), rel=1e-4)
    assert_nothing_held(llm.engine)
    with pytest.raises(ValueError, match="need 7 state slots while beams are forked; the cache has 4"):
        llm.beam_search([prompt, prompt], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    assert_nothing_held(llm.engine)


def test_chat_runs_a_hybrid_model_as_transformers_does(tmp_path):
    path = add_chat_tokenizer(make_hybrid_model(tmp_path, "qwen3_5", vocab_size=49152))
    llm = LLM(str(path), kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=4)
    sampled = recording(llm)
    output = llm.chat([{"role": "user", "content": "Where does the state live?"}], GREEDY)
    prompt = output.prompt_token_ids
    assert "Where does the state live?" in llm.tokenizer.decode(prompt)
    logits, generated = reference(path, prompt)
    assert_matches(logits, generated, prompt, output.outputs[0].token_ids, sampled[output.request_id])
    assert_nothing_held(llm.engine)


def test_a_state_dtype_other_than_float32_is_said_and_the_state_stays_float32(tmp_path, caplog):
    path = make_hybrid_model(tmp_path, "qwen3_next", mamba_ssm_dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4))
    assert "mamba_ssm_dtype='bfloat16' in the config, but kvserve keeps Gated DeltaNet states in float32" in caplog.text
    cache = engine.runner.state_cache
    assert cache.recurrent.dtype == cache.conv.dtype == torch.float32
    assert cache.nbytes == engine.cache_plan.state.total_bytes  # what the plan counted


@pytest.mark.parametrize("setting, name", [
    (dict(kv_eviction="streaming"), "kv_eviction"),
    (dict(kv_eviction="h2o"), "kv_eviction"),
    (dict(batch_invariant=True), "batch_invariant"),
])
def test_settings_not_built_yet_are_refused_by_name(tmp_path, setting, name):
    path = make_hybrid_model(tmp_path / "model", "qwen3_5")
    with pytest.raises(ValueError, match=f"{name} is not supported with hybrid models"):
        LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4, **setting))


# Qwen3.5/3.6 MoE (Qwen3.6-35B-A3B's layout): every layer routes each token to 2 of 4 experts beside the shared
# expert, no dense MLP (the config has no intermediate_size)
MOE_TEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def qwen3_5_moe_model(directory):
    text = {key: value for key, value in {**COMMON, **KINDS["qwen3_5"][2], **MOE_TEXT}.items()
            if key != "intermediate_size"}
    torch.manual_seed(0)
    return save_randomized(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text)), directory)


MOE_MODELS = {  # how to make one, and which of its 4 layers route to experts
    # Qwen3-Next: layer 0 keeps a dense MLP, the others route each token to 2 of 4 experts beside the shared expert
    "qwen3_next": (lambda directory: make_hybrid_model(directory, "qwen3_next", **MOE_TEXT, mlp_only_layers=[0]),
                   [False, True, True, True]),
    "qwen3_5_moe": (qwen3_5_moe_model, [True] * 4),
}


@pytest.mark.parametrize("kind", MOE_MODELS)
def test_sparse_moe_logits_match_transformers(tmp_path, kind):
    make, routed = MOE_MODELS[kind]
    path = make(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4,
                                    max_num_batched_tokens=24))
    assert [hasattr(layer.mlp, "moe") for layer in engine.model.layers] == routed
    assert all(layer.mlp.moe.num_experts == 4 for layer in engine.model.layers if hasattr(layer.mlp, "moe"))
    prompt = random_prompt(40, seed=2)
    ours, tokens = engine_logits(engine, prompt)
    logits, generated = reference(path, prompt)
    assert (ours - logits[: len(ours)]).abs().max() <= TOLERANCE
    assert tokens == generated
    assert_nothing_held(engine)


VISION_LANGUAGE = {
    "dense": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration, {}),
    "moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration, MOE_TEXT),
}


def add_mtp_weights(directory) -> None:
    """Add a multi-token prediction layer's weights to a saved model (the released checkpoints hold one beside the
    text model; transformers' models have none to save)."""
    path = directory / "model.safetensors"
    weights = safetensors.torch.load_file(path)
    weights |= {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.mlp.up_proj.weight": torch.randn(128, 64)}
    safetensors.torch.save_file(weights, path, metadata={"format": "pt"})


def test_a_causal_lm_checkpoint_skips_its_multi_token_prediction_layer(tmp_path, caplog):
    path = make_hybrid_model(tmp_path / "plain", "qwen3_next")
    prompt = random_prompt(37, seed=4)
    expected, _ = engine_logits(LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256,
                                                       max_num_seqs=4)), prompt)
    add_mtp_weights(path)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory="4MiB", max_model_len=256, max_num_seqs=4))
    assert "weights: the multi-token prediction layer skipped (kvserve runs the text model)" in caplog.text
    assert torch.equal(engine_logits(engine, prompt)[0], expected)


@pytest.mark.parametrize("kind", VISION_LANGUAGE)
def test_the_released_vision_language_layout_runs_its_text_model(tmp_path, caplog, kind):
    # Qwen3.5/3.6's checkpoints: *ForConditionalGeneration, the text model's config under text_config and its
    # weights under model.language_model, beside a vision tower
    config_cls, model_cls, extra = VISION_LANGUAGE[kind]
    text = {**COMMON, **KINDS["qwen3_5"][2], **extra}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
    torch.manual_seed(0)
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model_cls(config).eval().save_pretrained(tmp_path)
    add_mtp_weights(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_memory="4MiB", max_model_len=256,
                                        max_num_seqs=4))
    assert "weights: the multi-token prediction layer and the vision tower skipped" in caplog.text
    assert all(hasattr(layer.mlp, "moe") == bool(extra) for layer in engine.model.layers)
    prompt = random_prompt(37, seed=4)
    ours, tokens = engine_logits(engine, prompt)
    hf = model_cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt + tokens])).logits[0]
    assert (ours - logits[: len(ours)]).abs().max() <= TOLERANCE  # every prompt position and decode step
    # each greedy token is transformers' argmax after the tokens before it
    assert tokens == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert_nothing_held(engine)
