"""Bad input is refused at the edge with a ValueError that names the problem, and a refused request leaves
nothing behind: no queued request, no used block. Covers prompts, SamplingParams, EngineConfig and start-up."""
import pytest
import transformers

from kvserve import LLM, EngineConfig, SamplingParams
from tests.conftest import make_tiny_model
from tests.conftest import save_char_tokenizer

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("validation"), "llama-gqa")  # vocab 256, 1024 positions


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    """Every test ends with an idle engine and every block free, whatever it refused."""
    yield
    if "llm" in request.fixturenames:
        assert_idle(request.getfixturevalue("llm"))


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_prompt_plus_max_tokens_beyond_max_model_len_names_both(llm):
    with pytest.raises(ValueError, match=r"max_tokens=30 exceeds max_model_len=64 minus prompt length 40"):
        llm.generate(list(range(3, 43)), SamplingParams(max_tokens=30))
    ok = llm.generate(list(range(3, 43)), SamplingParams(max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert len(ok.token_ids) == 24  # exactly at the limit is allowed


def test_prompt_filling_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len=64 leaves no room"):
        llm.generate([5] * MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len=64 leaves no room"):
        llm.generate([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=1))


def test_scoring_a_prompt_may_fill_max_model_len(llm):
    """As vLLM: with nothing to generate but the one token the engine samples (which follows the last position
    and is never written to the cache), a scored prompt may fill the context."""
    prompt = [(7 * i) % 250 + 3 for i in range(MAX_MODEL_LEN)]
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    full = llm.generate(prompt, scoring)[0]
    shorter = llm.generate(prompt[:-1], scoring)[0]
    assert len(full.prompt_logprobs) == MAX_MODEL_LEN and len(full.outputs[0].token_ids) == 1
    for got, expected in zip(full.prompt_logprobs[1:-1], shorter.prompt_logprobs[1:]):  # up to float rounding
        assert got.keys() == expected.keys() and list(got.values()) == pytest.approx(list(expected.values()),
                                                                                    abs=1e-5)
    assert prompt[-1] in full.prompt_logprobs[-1]


def test_stop_token_ids_outside_the_vocab_are_refused(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids \[256\] are outside the vocabulary \[0, 256\)"):
        llm.generate([5, 6], SamplingParams(stop_token_ids=[3, 256]))


def test_max_tokens_none_fills_up_to_max_model_len(llm):
    out = llm.generate([5] * 60, SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_empty_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate({"prompt_token_ids": []})


def test_empty_text_prompt_is_refused(tmp_path):
    llm = LLM(str(save_char_tokenizer(make_tiny_model(tmp_path))), kv_cache_memory="1MiB", max_model_len=64)
    assert llm.tokenizer("").input_ids == []
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate("")


def test_text_prompt_needs_a_tokenizer(llm):
    with pytest.raises(ValueError, match="no tokenizer; pass prompt_token_ids"):
        llm.generate("hello")


def test_empty_token_list_is_refused_by_the_engine(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.engine.add_request("empty", [])


@pytest.mark.parametrize("bad", [256, 1000, -1])
def test_token_ids_outside_the_vocab_are_refused(llm, bad):
    with pytest.raises(ValueError, match=rf"prompt token ids \[{bad}\] are outside the vocabulary \[0, 256\)"):
        llm.generate([5, bad, 7])


def test_duplicate_request_id_is_refused_and_the_first_request_survives(llm):
    engine = llm.engine
    engine.add_request("same", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id 'same' is already in use"):
        engine.add_request("same", [8, 9], SamplingParams(max_tokens=3))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.prompt_token_ids, len(o.outputs[0].token_ids)) for o in finished] == [
        ("same", [5, 6, 7], 3)]


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [1, 2], "extra": 1}, r"exactly one of 'prompt' or 'prompt_token_ids'.*\['extra'"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of 'prompt' or 'prompt_token_ids'"),
    ({}, "exactly one of 'prompt' or 'prompt_token_ids'"),
    ({"cache_salt": "s"}, "exactly one of 'prompt' or 'prompt_token_ids'"),
    ({"prompt_token_ids": [1, 2], "cache_salt": 5}, "cache_salt must be a string"),
    ({"prompt_token_ids": [1, 2], "cache_salt": ""}, "cache_salt must be a non-empty string"),
    ({"prompt_token_ids": [1, 2], "cache_salt": "\udc80"}, "cache_salt must be valid Unicode text"),
    ({"prompt": "ab", "add_special_tokens": "no"}, "add_special_tokens must be true or false"),
    ({"prompt_token_ids": "some text"}, "'prompt_token_ids' a list of token ids"),
    ({"prompt": [1, 2, 3]}, "'prompt' must be a string"),
    ({"prompt_token_ids": {"prompt_token_ids": [1]}}, "'prompt_token_ids' a list of token ids"),
    ([1, 2.5], "a prompt must be a string, a list of token ids or a dict"),
    ([1, True], "a prompt must be a string, a list of token ids or a dict"),
    (3.5, "a prompt must be a string, a list of token ids or a dict, got float"),
])
def test_malformed_prompts_are_refused(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt)


@pytest.mark.parametrize("bad", [
    [9, 1000],  # token outside the vocab
    {"prompt_token_ids": [9], "oops": 1},
    [9] * 70,  # longer than max_model_len
    {"prompt_token_ids": []},
])
def test_one_bad_prompt_among_good_ones_queues_nothing(llm, bad):
    good = [[5, 6, 7], [8, 9, 10, 11] * 5]
    with pytest.raises(ValueError, match="^prompt 1: "):
        llm.generate([good[0], bad, good[1]], SamplingParams(max_tokens=4))
    assert_idle(llm)
    outputs = llm.generate(good, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == good  # only the new prompts ran


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([[5], [6]], [SamplingParams()])


def test_wrong_sampling_params_type_among_good_ones_queues_nothing(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=MAX_MODEL_LEN)  # its own: it may be left dirty
    with pytest.raises((TypeError, ValueError, AttributeError)):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2), {"max_tokens": 2}])
    assert_idle(llm)


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "n must be"),
    ("n", 2.0, "n must be an integer"),
    ("max_tokens", 0, "max_tokens must be"),
    ("max_tokens", 2.5, "max_tokens must be an integer"),
    ("temperature", -0.1, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0"),
    ("top_p", float("nan"), r"top_p must be in \(0, 1\]"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, "top_k must be"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("top_k", 2**63, r"top_k must be .* below 2\*\*63"),  # would overflow the sampler's int64 tensor
    ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
    ("min_p", 1.1, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be in \[0.01, 100\]"),
    ("repetition_penalty", 1e-40, r"repetition_penalty must be in \[0.01, 100\]"),  # logits / 1e-40 = inf
    ("presence_penalty", float("inf"), r"presence_penalty must be in \[-2, 2\]"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -2.5, r"frequency_penalty must be in \[-2, 2\]"),
    ("logprobs", 21, r"logprobs must be an integer in \[0, 20\]"),
    ("logprobs", -1, r"logprobs must be an integer in \[0, 20\]"),
    ("logprobs", 1.5, "logprobs must be an integer"),
    ("seed", 1.5, "seed must be an integer"),
    ("seed", 2**63, r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    ("stop", [""], "stop strings must be non-empty strings"),
    ("stop", ["ok", 3], "stop strings must be non-empty strings"),
    ("stop", [f"s{i}" for i in range(33)], "stop has 33 strings; at most 32"),
    ("stop", ["x" * 257], "at most 256 characters, got one of 257"),
    ("stop", ["a\ud800"], "stop strings must be valid Unicode text"),
    ("stop_token_ids", list(range(1025)), "stop_token_ids has 1025 ids; at most 1024"),
    ("stop_token_ids", [1, "2"], "stop_token_ids must be integers"),
])
def test_bad_sampling_params_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_unknown_sampling_option_is_an_error_not_ignored():
    with pytest.raises(TypeError, match="max_token"):
        SamplingParams(max_token=5)


def test_n_above_max_num_seqs_is_refused(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    with pytest.raises(ValueError, match="n=3 exceeds max_num_seqs=2"):
        llm.generate([5, 6], SamplingParams(n=3))
    assert_idle(llm)


def test_stop_strings_need_a_tokenizer(llm):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([5, 6], SamplingParams(stop=["x"]))


def test_engine_refuses_to_start_when_one_full_length_request_cannot_fit(model_dir):
    with pytest.raises(ValueError) as refused:
        LLM(str(model_dir), max_model_len=512, kv_cache_memory="64KiB")
    message = str(refused.value)
    assert "max_model_len 512" in message and "kv_cache_memory" in message
    assert "holds 128 tokens" in message and "The largest max_model_len that fits is 128" in message


def test_kv_cache_larger_than_the_machines_memory_is_refused_with_a_clear_message(model_dir):
    with pytest.raises(ValueError, match=r"kv_cache_memory=65,536.00 GiB is more than this machine's memory \(.* GiB\); "
                                         r"choose a smaller --kv-cache-memory"):
        LLM(str(model_dir), kv_cache_memory="64TiB")


def test_max_model_len_above_the_models_positions_is_refused(model_dir):
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's max_position_embeddings=1024"):
        LLM(str(model_dir), max_model_len=2048, kv_cache_memory="1MiB")


@pytest.mark.parametrize("option, value, message", [
    ("block_size", -16, "block_size must be a positive integer"),
    ("block_size", 0, "block_size must be a positive integer"),
    ("block_size", 2.5, "block_size must be a positive integer"),
    ("max_num_seqs", 0, "max_num_seqs must be a positive integer"),
    ("max_num_batched_tokens", -1, "max_num_batched_tokens must be a positive integer"),
    ("max_model_len", 0, "max_model_len must be a positive integer"),
    ("max_model_len", 100.5, "max_model_len must be a positive integer"),
    ("dtype", "float64", "dtype='float64' is not supported"),
    ("kv_cache_dtype", "int3", "kv_cache_dtype='int3' is not supported; choose one of auto, .*int8, int4"),
    ("kv_cache_dtype", "fp4", "kv_cache_dtype='fp4' is not supported"),
    ("kv_cache_memory", "2XB", "cannot read '2XB' as a size"),
    ("kv_cache_memory", "-1GiB", "cannot read '-1GiB' as a size"),
    ("kv_cache_memory", 0, "size must be positive"),
    ("enforce_eager", "yes", "enforce_eager must be True or False, got 'yes'"),
])
def test_bad_engine_config_is_refused(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{option: value})


@pytest.mark.parametrize("option, value", [("dtype", "fp32"), ("kv_cache_dtype", "float32"),
                                           ("kv_cache_memory", "512 MiB"), ("kv_cache_memory", 1 << 20)])
def test_good_engine_config_spellings_are_accepted(option, value):
    EngineConfig(**{option: value})


def test_unknown_engine_option_is_an_error_not_ignored(model_dir):
    with pytest.raises(TypeError, match="max_seqs"):
        LLM(str(model_dir), max_seqs=4)
