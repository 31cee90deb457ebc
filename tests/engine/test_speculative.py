"""Speculative decoding (kvserve/engine/speculative.py): greedy output token-identical with and without it over KV
formats, prefix hits, chunked prefill, batching, preemption mid-speculation and n > 1; rollback leaves no block
held and no rejected token in the prefix index; sampling keeps the target distribution; seeds give the same text
alone or batched, and as without speculation; bad configurations are refused by name.

A tiny random model never repeats itself, so the real proposers would seldom draft anything here: most tests give
the speculator an oracle that proposes the reference (non-speculative) continuation with one token in three
proposals wrong, so that whole drafts, partly rejected drafts and rejected first tokens all occur. The proposers
themselves are tested on token lists, and on the embedded SmolLM2 copying a text (slow)."""
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, SpeculativeConfig
from kvserve.engine.speculative import Speculator, _NgramIndex
from kvserve.kv.block_hash import hash_full_blocks
from tests.conftest import make_tiny_model

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
OPTIONS = dict(kv_cache_memory="2MiB", max_model_len=512, enforce_eager=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama-gqa")


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def oracle(llm: LLM, references: dict[tuple[int, ...], list[list[int]]], wrong_every: int = 3) -> dict[str, int]:
    """Make `llm`'s speculator propose each sequence's reference continuation (by its prompt and sample index),
    every `wrong_every`-th proposal with one token changed (which token varies)."""
    counts = {"proposals": 0}
    speculator = llm.engine.speculator

    def lookup(seq, limit):
        reference = references[tuple(seq.token_ids[: seq.num_prompt_tokens])][seq.index]
        done = seq.num_output_tokens
        draft = list(reference[done : done + limit])
        counts["proposals"] += 1
        if draft and counts["proposals"] % wrong_every == 0:
            at = counts["proposals"] % len(draft)
            draft[at] = (draft[at] + 1) % 256
        return draft

    speculator.lookup = lookup
    return counts


def run_both(model_dir, prompts, params=GREEDY, wrong_every=3, **options):
    """Outputs without speculation, then with the oracle speculating; and the speculating LLM."""
    plain = LLM(str(model_dir), **{**OPTIONS, **options})
    expected = plain.generate(prompts, params)
    spec = LLM(str(model_dir), **{**OPTIONS, **options, "speculative_config": NGRAM})
    references = {tuple(o.prompt_token_ids): [c.token_ids for c in o.outputs] for o in expected}
    oracle(spec, references, wrong_every)
    return expected, spec.generate(prompts, params), spec


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_nothing_held(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8", "int8", "int4", "nuq4", "nuq3"])
def test_greedy_output_is_the_same_with_speculation_in_every_format(llama, kv_cache_dtype):
    prompts = [prompt(37, seed) for seed in range(3)]
    expected, got, spec = run_both(llama, prompts, kv_cache_dtype=kv_cache_dtype)
    assert tokens(got) == tokens(expected)
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0  # whole drafts were accepted ...
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # ... and some rejected
    assert sum(o.num_accepted_tokens for o in got) == stats["spec_decode_num_accepted_tokens"]
    # each step keeps at least one token: fewer steps than tokens, so decode steps were saved
    assert stats["spec_decode_num_drafts"] < 3 * (GREEDY.max_tokens - 1)
    assert_nothing_held(spec)


def test_sliding_window_layers_and_latent_attention(tmp_path):
    from tests.model.test_deepseek import make_deepseek

    gemma = make_tiny_model(tmp_path / "gemma", "gemma3-mqa", num_hidden_layers=2, sliding_window=32,
                            max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"])
    deepseek = make_deepseek(tmp_path / "deepseek", "v3")
    prompts = [prompt(50, seed) for seed in range(2)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for model_dir in (gemma, deepseek):
        expected, got, spec = run_both(model_dir, prompts, params)
        assert tokens(got) == tokens(expected), model_dir.name
        assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
        assert_nothing_held(spec)


def test_int4_drafts_stop_short_of_a_blocks_last_slot(llama):
    spec = LLM(str(llama), **OPTIONS, kv_cache_dtype="int4", speculative_config=NGRAM)
    room = spec.engine.cache.max_draft_tokens
    assert [room(p) for p in (0, 13, 14, 15, 16)] == [14, 1, 0, 15, 14]
    auto = LLM(str(llama), **OPTIONS, speculative_config=NGRAM)
    assert auto.engine.cache.max_draft_tokens(14) is None


def test_prefix_hits_chunked_prefill_and_batches(llama):
    system = prompt(48, 7)
    prompts = [system + prompt(20 + 9 * i, i) for i in range(5)]
    expected, got, spec = run_both(llama, prompts, max_num_batched_tokens=24)  # prompts arrive in chunks
    assert tokens(got) == tokens(expected)
    assert sum(o.num_cached_tokens for o in got) >= 4 * 48  # the system prompt's blocks were hits
    assert_nothing_held(spec)


def test_preemption_mid_speculation(llama):
    prompts = [prompt(60, seed) for seed in range(6)]
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    # 160 KiB: 20 blocks of 16 tokens for six sequences growing to 12 blocks each
    expected, got, spec = run_both(llama, prompts, params, kv_cache_memory="160KiB", max_model_len=256)
    assert tokens(got) == tokens(expected)
    assert spec.stats()["num_preemptions"] > 0 and spec.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_nothing_held(spec)


def test_n_samples_and_stops(llama):
    prompts = [prompt(30, 1), prompt(45, 2)]
    params = SamplingParams(n=2, max_tokens=33, temperature=0, ignore_eos=True)
    expected, got, spec = run_both(llama, prompts, params)
    assert tokens(got) == tokens(expected)
    # a stop token inside an accepted draft ends the sequence there
    stop_at = expected[0].outputs[0].token_ids[10]
    stopping = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    expected, got, spec = run_both(llama, prompts[:1], stopping, wrong_every=1000)
    assert tokens(got) == tokens(expected) and got[0].outputs[0].finish_reason == "stop"
    assert_nothing_held(spec)


def test_rollback_frees_rejected_blocks_and_indexes_only_accepted_tokens(llama):
    tokens_in = prompt(31, 3)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    reference = LLM(str(llama), **OPTIONS).generate(tokens_in, params)[0].outputs[0].token_ids
    spec = LLM(str(llama), **OPTIONS, speculative_config={**NGRAM, "num_speculative_tokens": 15})
    oracle(spec, {tuple(tokens_in): [reference]}, wrong_every=1)  # every draft has a wrong token
    engine, held = spec.engine, []
    engine.add_request("r", {"prompt_token_ids": tokens_in}, params)
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            table = engine.kv.block_table(seq.request_id, 0)
            held.append((len(table.blocks), -(-seq.num_computed_tokens // 16)))
    assert held and all(num_blocks == needed for num_blocks, needed in held)  # no block past the computed ones
    assert_nothing_held(spec)
    # every block the prefix index holds is a block of the real (accepted) tokens
    real = set(hash_full_blocks(tokens_in + reference, 16, namespace=engine.config.kv_cache_format))
    cached = set(engine.kv.pool._cached)
    assert cached and cached <= real


def test_batch_invariant_mode_gives_bitwise_the_same_logprobs(llama):
    prompts = [prompt(29, seed) for seed in range(2)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3)
    expected, got, spec = run_both(llama, prompts, params, batch_invariant=True)
    assert tokens(got) == tokens(expected)
    assert [[c.logprobs for c in o.outputs] for o in got] == [[c.logprobs for c in o.outputs] for o in expected]
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_seeds_give_the_same_text_alone_or_batched(llama):
    seeded = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    references = {}
    spec = LLM(str(llama), **OPTIONS, speculative_config=NGRAM)
    target = prompt(33, 4)
    greedy_ref = LLM(str(llama), **OPTIONS).generate(target, GREEDY)[0].outputs[0].token_ids
    references[tuple(target)] = [greedy_ref]
    for seed in range(3):
        references[tuple(prompt(40, 10 + seed))] = [greedy_ref]
    oracle(spec, references)  # drafts from the greedy text: some accepted under sampling, most not
    alone = spec.generate(target, seeded)[0].outputs[0].token_ids
    others = [prompt(40, 10 + seed) for seed in range(3)]
    batched = spec.generate([target, *others], [seeded] + [SamplingParams(max_tokens=30, temperature=1.0)] * 3)
    assert batched[0].outputs[0].token_ids == alone
    assert spec.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("n", [1, 2])
def test_seeds_give_the_same_text_as_without_speculation(llama, n):
    """A verification row draws for every draft token, accepted or not, so a sequential stream would give another
    text than plain decoding; draws keyed by (seed, position) give the same one, whatever was drafted."""
    seeded = SamplingParams(n=n, max_tokens=30, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    prompts = [prompt(33, 4), prompt(21, 8)]
    expected, got, spec = run_both(llama, prompts, seeded)
    assert tokens(got) == tokens(expected)
    stats = spec.stats()
    # drafts from the plain text, one in three with a wrong token: rejected rows drew, accepted ones too
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]


def test_penalties_see_the_drafts_before_each_row(llama):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5)
    expected, got, _ = run_both(llama, [prompt(20, 5)], params)
    assert tokens(got) == tokens(expected)


def test_beam_search_runs_with_a_speculating_engine(llama):
    from kvserve import BeamSearchParams

    plain = LLM(str(llama), **OPTIONS).beam_search(prompt(20, 6), BeamSearchParams(beam_width=2, max_tokens=8))
    spec = LLM(str(llama), **OPTIONS, speculative_config=NGRAM)
    got = spec.beam_search(prompt(20, 6), BeamSearchParams(beam_width=2, max_tokens=8))
    assert [s.token_ids for s in got[0].sequences] == [s.token_ids for s in plain[0].sequences]
    assert not spec.engine.speculator.paused


# ---- the rule that keeps the distribution ---------------------------------------------------------------------
class _Row:
    """What the sampler reads of a sequence."""

    def __init__(self, params):
        self.params, self.seed, self.request_id = params, None, "row"
        self.token_ids, self.output_token_ids = [0], [0]
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.grammar = None


def test_sampling_drafts_keeps_the_target_distribution():
    """Rows 0 and 1 with known distributions over 6 tokens, the draft (2, 4): the first output token must follow
    row 0's distribution, and after an accepted 2 the next must follow row 1's, whatever the draft proposes."""
    p0 = torch.tensor([0.05, 0.15, 0.30, 0.10, 0.25, 0.15])
    p1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
    logits = torch.stack([p0.log(), p1.log(), torch.zeros(6)])
    speculator = Speculator(SpeculativeConfig(**NGRAM), cache=None)
    row, generator = _Row(SamplingParams(temperature=1.0)), torch.Generator().manual_seed(0)
    trials = 12_000
    first, second, lengths = torch.zeros(6), torch.zeros(6), torch.zeros(3)
    for _ in range(trials):
        samples, accepted = speculator.sample_drafted(logits, row, [2, 4], generator)
        first[samples[0][0]] += 1
        lengths[accepted] += 1
        if accepted >= 1:
            second[samples[1][0]] += 1
    total_variation = lambda counts, p: 0.5 * float((counts / counts.sum() - p).abs().sum())  # noqa: E731
    assert total_variation(first, p0) < 0.02
    assert total_variation(second, p1) < 0.03
    # acceptance: the first draft token with p0(2) = 0.3, both with 0.3 * p1(4) = 0.03
    assert abs(lengths[1:].sum() / trials - 0.30) < 0.02 and abs(lengths[2] / trials - 0.03) < 0.01


# ---- proposers -------------------------------------------------------------------------------------------------
def test_ngram_index_finds_the_latest_earlier_occurrence():
    index = _NgramIndex(range(2, 5))
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    index.update(tokens)
    assert index.find(tokens, 3) == 7  # "1 2 3" last occurred at 4..6, followed by 7
    assert index.find(tokens, 4) is None  # "3 1 2 3" never occurred before
    assert index.find([5, 6], 2) is None


def test_the_ngram_proposer_drafts_from_the_prompt_and_respects_the_limits(llama):
    spec = LLM(str(llama), **OPTIONS, speculative_config=NGRAM)
    speculator = spec.engine.speculator
    seq = spec.engine.add_request("x", {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]},
                                  SamplingParams(max_tokens=3)).sequences[0]
    assert speculator.propose(seq, max_tokens=10, num_decoding=1) == [8, 9]  # max_tokens 3: 2 drafts at most
    seq.max_tokens = 20
    assert speculator.propose(seq, max_tokens=10, num_decoding=1) == [8, 9, 10, 11]
    assert speculator.propose(seq, max_tokens=2, num_decoding=1) == [8, 9]  # the step's token budget
    assert speculator.propose(seq, max_tokens=10, num_decoding=speculator.max_batch + 1) == []
    spec.engine.abort_request("x")


def test_the_ngram_proposer_drafts_a_loop_in_full(llama):
    """Issue 57: on a one-token loop the latest earlier occurrence's continuation runs into the present; the draft
    repeats the cycle up to num_speculative_tokens, and a longer cycle repeats as a whole."""
    spec = LLM(str(llama), **OPTIONS, speculative_config=NGRAM)
    speculator = spec.engine.speculator
    for prompt_ids, expected in [([9, 5, 5, 5, 5], [5, 5, 5, 5]), ([9, 5, 6, 5, 6, 5], [6, 5, 6, 5]),
                                 ([1, 2, 3, 4, 1, 2], [3, 4, 1, 2])]:
        seq = spec.engine.add_request("loop", {"prompt_token_ids": prompt_ids},
                                      SamplingParams(max_tokens=20)).sequences[0]
        assert speculator.propose(seq, max_tokens=10, num_decoding=1) == expected, prompt_ids
        spec.engine.abort_request("loop")


def test_a_loop_decodes_the_same_with_full_drafts(llama):
    loop = [7] * 12 + [8, 9] * 6
    plain = LLM(str(llama), **OPTIONS).generate(loop, GREEDY)
    spec = LLM(str(llama), **OPTIONS, speculative_config=NGRAM)
    assert tokens(spec.generate(loop, GREEDY)) == tokens(plain)
    assert_nothing_held(spec)


def test_the_suffix_proposer_uses_recent_requests_outputs(llama):
    spec = LLM(str(llama), **OPTIONS, speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    speculator = spec.engine.speculator
    done = spec.engine.add_request("a", {"prompt_token_ids": [3, 3]}, SamplingParams(max_tokens=50)).sequences[0]
    done.token_ids += [40, 41, 42, 43, 44, 45, 46, 47]
    spec.engine.abort_request("a")  # finishing hands its output to the suffix index
    seq = spec.engine.add_request("b", {"prompt_token_ids": [9, 9, 41, 42, 43]},
                                  SamplingParams(max_tokens=50)).sequences[0]
    assert speculator.propose(seq, max_tokens=10, num_decoding=1) == [44, 45, 46]  # 3 matched: 3 proposed
    speculator.forget_outputs()  # the bench, between timed runs
    assert speculator.propose(seq, max_tokens=10, num_decoding=1) == []
    spec.engine.abort_request("b")


def test_the_suffix_proposer_keeps_one_index_per_cache_salt(llama):
    """Issue 57: one tenant's outputs never become another's drafts; the output is the same either way."""
    spec = LLM(str(llama), **OPTIONS, speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    speculator = spec.engine.speculator
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    for salt in ["tenant-a", None]:
        done = spec.engine.add_request(f"done-{salt}", {"prompt_token_ids": [3, 3], "cache_salt": salt},
                                       SamplingParams(max_tokens=50)).sequences[0]
        done.token_ids += output
        spec.engine.abort_request(f"done-{salt}")  # finishing hands its output to its salt's index
    asking = {"tenant-a": [44, 45, 46], "tenant-b": [], None: [44, 45, 46]}
    for salt, expected in asking.items():
        seq = spec.engine.add_request(f"ask-{salt}", {"prompt_token_ids": [9, 9, 41, 42, 43], "cache_salt": salt},
                                      SamplingParams(max_tokens=50)).sequences[0]
        assert speculator.propose(seq, max_tokens=10, num_decoding=1) == expected, salt
        spec.engine.abort_request(f"ask-{salt}")
    prompts = [prompt(24, seed) for seed in range(3)]
    plain = LLM(str(llama), **OPTIONS).generate(prompts * 2, GREEDY)
    salted = [{"prompt_token_ids": p, "cache_salt": salt} for salt in ["tenant-a", "tenant-b"] for p in prompts]
    assert tokens(spec.generate(salted, GREEDY)) == tokens(plain)
    assert_nothing_held(spec)


def test_the_outputs_of_all_salts_share_one_capacity():
    from kvserve.engine.speculative import _OutputsBySalt

    recent = _OutputsBySalt(capacity=3, depth=2)
    for i, salt in enumerate(["a", "b", "a", "c"]):
        recent.add(salt, [10 * i, 10 * i + 1, 10 * i + 2])
    assert recent.continuation("a", [0], 1, 2) == []  # the oldest output of all was dropped
    assert recent.continuation("a", [20], 1, 2) == [21, 22]
    assert recent.continuation("b", [20], 1, 2) == [] and recent.continuation("b", [10], 1, 2) == [11, 12]
    assert recent.continuation("c", [30], 1, 2) == [31, 32]
    recent.add("c", [50, 51])
    assert "b" not in recent.by_salt and len(recent.order) == 3


def test_the_suffix_index_keeps_the_last_outputs_in_bounded_memory():
    """docs/speculative.md's figure: 100 outputs of 500 distinct tokens at depth 24 take about 135 MiB (measured
    here; tracemalloc), and older outputs stop being found."""
    import random
    import tracemalloc

    from kvserve.engine.speculative import _OutputsBySalt

    rng = random.Random(0)
    outputs = [[rng.randrange(49152) for _ in range(500)] for _ in range(101)]
    tracemalloc.start()
    recent = _OutputsBySalt(capacity=100, depth=24)
    for output in outputs[1:]:
        recent.add(None, output)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"suffix index: {recent.num_entries:,} entries, {used / 2**20:.0f} MiB")
    assert used < 160 * 2**20
    recent.add(None, outputs[0])  # pushes out the oldest kept output (outputs[1])
    assert recent.continuation(None, outputs[0][:30], 24, 3) == outputs[0][30:33]
    assert recent.continuation(None, outputs[1][:30], 24, 3) == []
    assert recent.continuation(None, outputs[2][:30], 24, 3) == outputs[2][30:33]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle"}, "method='eagle' is not supported; choose one of ngram, suffix"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5 is more than"),
    ({"method": "ngram", "lookahead": 3}, "unknown keys ['lookahead']; the keys are method, num_speculative_tokens"),
    ({"num_speculative_tokens": 3}, "needs a method: one of ngram, suffix"),
    ("{not json", "speculative_config is not valid JSON"),
])
def test_bad_configurations_are_refused_by_name(config, message):
    with pytest.raises(ValueError) as error:
        EngineConfig(speculative_config=config)
    assert message in str(error.value)


def test_h2o_is_refused():
    with pytest.raises(ValueError, match="does not combine with kv_eviction='h2o': its scores add up the attention"):
        EngineConfig(speculative_config=NGRAM, kv_eviction="h2o")


STREAMING = dict(kv_eviction="streaming", kv_sink_tokens=4, kv_recent_tokens=32)


def test_streaming_llm_gives_the_same_greedy_output_with_speculation(llama):
    """StreamingLLM keeps what positions say (the sinks and a window), so verifying a draft keeps what decoding
    token by token keeps: the same tokens, as the window slides past blocks."""
    prompts = [prompt(37, seed) for seed in range(3)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected, got, spec = run_both(llama, prompts, params, **STREAMING)
    assert tokens(got) == tokens(expected)
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["num_window_blocks_freed"] > 0 or stats["num_evicted_blocks"] > 0
    assert_nothing_held(spec)


PER_HEAD = dict(kv_eviction="perhead-mix", kv_sink_tokens=4, kv_recent_tokens=8, kv_budget_tokens=48)


def stream_lengths(llm: LLM) -> dict[str, tuple[int, int]]:
    """Each running sequence's (tokens computed, the longest stream's length)."""
    manager = llm.engine.kv.groups[0]
    return {s.request_id: (s.num_computed_tokens, int(manager.streams[s.request_id].lengths.max()))
            for s in llm.engine.scheduler.running}


def test_per_head_streams_drop_rejected_drafts(llama):
    """A verified draft's rejected tokens leave every (layer, head) stream, their head blocks go back; with room for
    every token the output is the output without speculation, and compressed it runs to the end, holding nothing."""
    prompts = [prompt(37, seed) for seed in range(3)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    roomy = {**PER_HEAD, "kv_budget_tokens": 200}
    expected, got, spec = run_both(llama, prompts, params, **roomy)
    assert tokens(got) == tokens(expected)
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["num_evicted_blocks"] == 0
    assert_nothing_held(spec)
    # compressed: every stream holds at most the sequence's computed tokens after each step (no rejected token)
    expected, _, spec = run_both(llama, prompts[:1], params, **PER_HEAD)
    engine, seen = spec.engine, []
    engine.add_request("c", prompts[0], params)
    while engine.has_unfinished_requests():
        engine.step()
        seen += [(n, longest) for n, longest in stream_lengths(spec).values()]
    assert all(longest <= n for n, longest in seen)
    stats = spec.stats()
    assert stats["num_evicted_blocks"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] and engine.cache.query_stats == {}


def test_the_cli_flag_takes_json(llama):
    import argparse

    from kvserve.engine.cli import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 3
