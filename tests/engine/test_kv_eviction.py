"""Eviction inside the engine: a StreamingLLM sequence equals a plain reference decoder (sinks + window, cache
positions) token for token, prefilled whole, in chunks or decoded, and runs past max_model_len in bounded blocks;
H2O stays within its budget; prefix-cache hits never serve K/V computed on a pruned context; nothing leaks after
aborts, preemption and n>1."""
import logging

import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

MAX_LEN = 64
SINKS, RECENT = 4, 40
STREAMING = dict(kv_eviction="streaming", kv_sink_tokens=SINKS, kv_recent_tokens=RECENT)
H2O = dict(kv_eviction="h2o", kv_sink_tokens=4, kv_recent_tokens=20, kv_budget_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("eviction"), "llama-gqa")


def make(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"kv_cache_memory": "1MiB", "max_model_len": MAX_LEN, **options})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin


@torch.no_grad()
def reference_streaming_logits(hf, token_ids: list[int], sinks: int, recent: int) -> torch.Tensor:
    """StreamingLLM written plainly: tokens one at a time; each layer keeps every token's K (before RoPE) and V;
    the query at position p attends to the first `sinks` tokens and the last `recent` (itself included), keys
    rotated by their place in that cache and the query by its own place, the last."""
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim, theta = cfg.hidden_size // heads, cfg.rope_parameters["rope_theta"]
    keys = [[] for _ in hf.model.layers]
    values = [[] for _ in hf.model.layers]
    logits = []
    for p, token in enumerate(token_ids):
        h = hf.model.embed_tokens(torch.tensor([token]))
        kept = sorted(set(range(min(sinks, p + 1))) | set(range(max(0, p - recent + 1), p + 1)))
        for i, layer in enumerate(hf.model.layers):
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = attn.q_proj(x).view(heads, dim)
            keys[i].append(attn.k_proj(x).view(kv_heads, dim))
            values[i].append(attn.v_proj(x).view(kv_heads, dim))
            k = rope(torch.stack([keys[i][t] for t in kept]), torch.arange(len(kept)), theta)
            v = torch.stack([values[i][t] for t in kept])
            q = rope(q[None], torch.tensor([len(kept) - 1]), theta)[0]
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            weights = torch.einsum("hd,khd->hk", q, k) / dim**0.5
            out = torch.einsum("hk,khd->hd", weights.softmax(-1), v)
            h = h + attn.o_proj(out.reshape(1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(hf.lm_head(hf.model.norm(h))[0])
    return torch.stack(logits)


def engine_step_logits(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was sampled from."""
    engine, sampled = llm.engine, []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: sampled.append(compute(hidden)) or sampled[-1]
    try:
        output = llm.generate(prompt, greedy(max_tokens))[0]
    finally:
        engine.model.compute_logits = compute
    return output.outputs[0].token_ids, [logits[-1] for logits in sampled if len(logits)]


@pytest.mark.parametrize("prompt_len, chunk", [(1, 2048), (100, 2048), (100, 24)])
def test_streaming_equals_a_plain_reference_decoder_past_max_model_len(model_dir, prompt_len, chunk):
    prompt = torch.randint(3, 256, (prompt_len,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = make(model_dir, max_num_batched_tokens=chunk, **STREAMING)
    tokens, step_logits = engine_step_logits(llm, prompt, 3 * MAX_LEN)
    assert len(prompt + tokens) > 3 * MAX_LEN and llm.stats()["num_evicted_blocks"] > 0

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = reference_streaming_logits(hf, prompt + tokens, SINKS, RECENT)
    for i, logits in enumerate(step_logits):  # step i samples output token i from position prompt_len - 1 + i
        assert (logits - reference[prompt_len - 1 + i]).abs().max() <= 1e-4, f"decode step {i}"
    scored = llm.generate(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=-1))[0].prompt_logprobs
    assert (scored[1:] - reference[:-1].log_softmax(-1)).abs().max() <= 1e-4  # every position, prefilled


def test_streaming_blocks_stay_bounded_at_every_step_and_nothing_leaks(model_dir):
    llm = make(model_dir, **STREAMING)
    engine = llm.engine
    bound = engine.eviction.max_blocks(16)
    g = torch.Generator().manual_seed(4)
    for i, n in enumerate([3, 17, 50]):
        engine.add_request(f"r{i}", torch.randint(3, 256, (n,), generator=g).tolist(), greedy(3 * MAX_LEN))
    engine.add_request("n2", [7, 8, 9], SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=3 * MAX_LEN))
    engine.add_request("gone", [1, 2, 3], greedy(3 * MAX_LEN))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 80:
            engine.abort_request("gone")
        for seq in engine.scheduler.running:
            assert len(engine.kv.block_ids(seq.request_id)) <= bound
    stats = llm.stats()
    assert stats["num_evicted_blocks"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_streaming_outputs_survive_preemption_unchanged(model_dir):
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 60)]
    alone = [make(model_dir, **STREAMING).generate(p, greedy(150))[0].outputs[0].token_ids for p in prompts]
    block_bytes = make(model_dir, **STREAMING).engine.cache_plan.block_bytes
    tight = make(model_dir, kv_cache_memory=12 * block_bytes, **STREAMING)  # room for two sequences, not three
    outputs = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy(150))]
    assert tight.stats()["num_preemptions"] > 0
    assert outputs == alone  # recomputed in one prefill, each query sees the same sinks and window


def test_h2o_stays_within_its_budget_and_keeps_what_attention_reads(model_dir):
    llm = make(model_dir, max_model_len=160, **H2O)
    engine = llm.engine
    bound = engine.eviction.max_blocks(16)
    engine.add_request("a", torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist(),
                       greedy(120))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            kept = engine.kv.block_ids(seq.request_id)
            assert len(kept) <= bound
            assert float(engine.scores.per_slot.view(-1, 16)[kept].sum()) > 0  # every layer adds what it read
    assert llm.stats()["num_evicted_blocks"] > 0


def test_h2o_survives_preemption_without_leaks(model_dir):
    # Recomputing after preemption scores a prompt in one prefill instead of token by token, so H2O may keep other
    # blocks than it did the first time: outputs can differ, but the budget holds and every block comes back.
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 20, 30)]
    block_bytes = make(model_dir, **H2O).engine.cache_plan.block_bytes
    tight = make(model_dir, kv_cache_memory=10 * block_bytes, max_model_len=160, **H2O)
    outputs = tight.generate(prompts, greedy(120))
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["num_evicted_blocks"] > 0
    assert all(len(o.outputs[0].token_ids) == 120 for o in outputs)


PERHEAD = dict(kv_eviction="perhead-span", kv_sink_tokens=4, kv_recent_tokens=16, kv_budget_tokens=48)


@pytest.mark.parametrize("options,moves", [(STREAMING, False), (H2O, True), (PERHEAD, True)],
                         ids=["streaming", "h2o", "perhead-span"])
def test_start_up_says_whether_chunking_moves_the_tokens(model_dir, caplog, options, moves):
    """H2O and the per-head policies decide between prompt chunks, so a prompt prefilled 16 tokens a step keeps
    other tokens than one prefilled whole, and gives other text; StreamingLLM does not. The start-up line says
    which (the batch chunks prompts by its token budget, so "batched or alone" cannot hold where chunking moves)."""
    prompts = [torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        whole = make(model_dir, max_model_len=160, **options)
        chunked = make(model_dir, max_model_len=160, max_num_batched_tokens=16, **options)
    texts = [[llm.generate(p, greedy(30))[0].outputs[0].token_ids for p in prompts] for llm in (whole, chunked)]
    assert (texts[0] != texts[1]) == moves
    lines = {r.getMessage() for r in caplog.records if r.getMessage().startswith("batch invariance: ")}
    expected = (f"batch invariance: none under {options['kv_eviction']} eviction" if moves
                else "batch invariance: same greedy tokens batched or alone")
    assert len(lines) == 1 and lines.pop().startswith(expected)


@pytest.mark.parametrize("options", [STREAMING, H2O], ids=["streaming", "h2o"])
def test_prefix_cache_only_holds_blocks_an_uncompressed_run_computes(model_dir, options):
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    shared = make(model_dir, max_model_len=160, **options)
    history = prompt + shared.generate(prompt, greedy(120))[0].outputs[0].token_ids
    assert shared.stats()["num_evicted_blocks"] > 0
    uncompressed = make(model_dir, max_model_len=160)
    uncompressed.generate(history, greedy(1))
    expected = {b.block_hash: b.block_id for b in uncompressed.engine.kv.pool.blocks if b.block_hash}
    registered = [b for b in shared.engine.kv.pool.blocks if b.block_hash]
    assert 0 < len(registered) < len(expected)  # registering stopped where the context was first pruned
    for block in registered:  # a later hit reads exactly what a fresh computation would
        ours, theirs = slice(block.block_id * 16, block.block_id * 16 + 16), expected[block.block_hash]
        theirs = slice(theirs * 16, theirs * 16 + 16)
        for mine, ref in ((shared.engine.cache.k, uncompressed.engine.cache.k),
                          (shared.engine.cache.v, uncompressed.engine.cache.v)):
            assert torch.allclose(mine[:, ours], ref[:, theirs], atol=1e-5)

    follow_up = history[:56]
    hit = shared.generate(follow_up, greedy(4))[0]
    fresh = make(model_dir, max_model_len=160, enable_prefix_caching=False, **options).generate(follow_up, greedy(4))
    assert hit.num_cached_tokens > 0 and hit.outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_bad_eviction_options_are_refused_naming_the_problem(model_dir):
    with pytest.raises(ValueError, match="kv_eviction='lru' is not supported; choose one of none, streaming, h2o"):
        make(model_dir, kv_eviction="lru")
    with pytest.raises(ValueError, match="kv_budget_tokens=32 leaves no room for heavy hitters"):
        make(model_dir, kv_eviction="h2o", kv_budget_tokens=32, kv_recent_tokens=20)
    with pytest.raises(ValueError, match="kv_recent_tokens must be at least 1"):
        make(model_dir, kv_eviction="streaming", kv_recent_tokens=0)


def test_streaming_takes_prompts_past_max_model_len_as_chat_needs(model_dir):
    long_prompt = torch.randint(3, 256, (3 * MAX_LEN,), generator=torch.Generator().manual_seed(8)).tolist()
    with pytest.raises(ValueError, match="max_model_len=64 leaves no room"):
        make(model_dir).generate(long_prompt, greedy(4))
    llm = make(model_dir, **STREAMING)
    assert len(llm.generate(long_prompt, greedy(4))[0].outputs[0].token_ids) == 4
    assert llm.stats()["num_evicted_blocks"] > 0
