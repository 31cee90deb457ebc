"""Sliding-window attention with a cache that frees what falls out of the window: a tiny Mistral (every layer
slides) and a tiny hybrid Gemma 3 (sliding and full layers interleaved), both with a 32-token window, give
transformers' logits at every position of prompts four times the window, prefilled whole, in chunks, batched and
preempted; sliding layers hold at most ceil(window / 16) + 1 blocks, full layers every block; prefix hits bring
only the window the sliding layers need."""
import pytest
import torch
import transformers

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model

WINDOW = 32
BS = 16


@pytest.fixture(scope="module", params=["mistral", "gemma3-hybrid"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3-hybrid":  # layer groups of one layer: sliding, sliding, full, sliding
        return make_tiny_model(directory, "gemma3-mqa", num_hidden_layers=4, sliding_window=WINDOW,
                               max_position_embeddings=512, layer_types=["sliding_attention", "sliding_attention",
                                                                         "full_attention", "sliding_attention"])
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"kv_cache_memory": "1MiB", "max_model_len": 512, **options})


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def reference_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("chunk", [2048, 24, 7], ids=["whole", "chunks-of-24", "chunks-of-7"])
def test_every_position_matches_transformers_past_the_window(model_dir, hf, chunk):
    prompt = prompts(4 * WINDOW + 5)[0]
    out = make(model_dir, max_num_batched_tokens=chunk).generate(
        prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=-1))[0]
    reference = reference_logprobs(hf, prompt + out.outputs[0].token_ids)
    assert (out.prompt_logprobs[1:] - reference[: len(prompt) - 1]).abs().max() <= 1e-4
    generated = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert out.outputs[0].token_ids == generated[0, len(prompt):].tolist()


def test_batched_and_preempted_outputs_equal_each_prompt_alone(model_dir):
    batch = prompts(5, 40, 90, 4 * WINDOW, 150)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    single = make(model_dir, enable_prefix_caching=False)
    alone = [single.generate(p, greedy)[0].outputs[0].token_ids for p in batch]
    assert [o.outputs[0].token_ids for o in make(model_dir).generate(batch, greedy)] == alone
    plan = single.engine.cache_plan
    room = plan.request_bytes(256) + 3 * plan.block_bytes  # one long request fits; five at once do not
    tight = make(model_dir, kv_cache_memory=room, max_model_len=256)
    assert [o.outputs[0].token_ids for o in tight.generate(batch, greedy)] == alone
    assert tight.stats()["num_preemptions"] > 0


def test_decodes_read_in_place_past_the_window_match_transformers(model_dir, hf, monkeypatch):
    """--compile-decode reads float32 blocks in place (kv/formats/flex_decode.py): a window's first block is read in
    part, as is the block still filling, and batched requests of unlike lengths attend in one call (in the graph
    with attention outside it: a tiny model's batches would run the whole graph)."""
    from kvserve.compile import steps as compiled_step

    monkeypatch.setattr(compiled_step, "WHOLE_GRAPH_KV_BYTES", 0)
    batch = prompts(5, 40, 90, 4 * WINDOW, 150)
    llm = make(model_dir, compile_decode=True)
    assert llm.engine.cache.decode_reads_in_place()
    outs = llm.generate(batch, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0))
    assert llm.engine.runner.compiled.num_outside_steps >= 39  # the batch's decode steps
    for prompt, out in zip(batch, outs):
        tokens = out.outputs[0].token_ids
        reference = reference_logprobs(hf, prompt + tokens)[len(prompt) - 1 : -1]
        got = torch.tensor([lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)])
        assert (got - reference[torch.arange(len(tokens)), tokens]).abs().max() <= 1e-4


def test_blocks_held_stay_within_the_window_and_come_back(model_dir):
    llm = make(model_dir)
    engine = llm.engine
    engine.add_request("long", prompts(10)[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    bound = -(-WINDOW // BS) + 1
    windows = engine.kv.windows
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            for group, window in enumerate(windows):
                held = len(engine.kv.block_table(seq.request_id, group).blocks)
                assert held <= bound if window else held == -(-seq.num_computed_tokens // BS)
            stats = llm.stats()
            assert WINDOW - 1 <= stats["num_tokens_stored_sliding"] < bound * BS or seq.num_computed_tokens < WINDOW
            assert 0 <= stats["slot_waste_tokens"] < BS * len(windows)
    stats = llm.stats()
    assert stats["num_window_blocks_freed"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_prefix_hits_bring_only_the_window_they_need(model_dir, hf):
    llm = make(model_dir)
    history = prompts(150)[0]
    llm.generate(history, SamplingParams(max_tokens=1))
    follow_up = history + prompts(1)[0][:5]
    out = llm.generate(follow_up, SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    assert out.num_cached_tokens == 144  # 9 whole blocks: the window before token 144 is still cached
    expected = int(reference_logprobs(hf, follow_up)[-1].argmax())
    assert out.outputs[0].token_ids == [expected]
