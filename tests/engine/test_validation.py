"""Request validation against made-up limits (no model is built): each refusal names the problem and its bound.
tests/engine/test_request_validation.py checks the same through a real engine."""
import pytest

from kvserve.engine.validation import RequestValidator, checked_params
from kvserve.sampling_params import SamplingParams


def validator(**overrides) -> RequestValidator:
    limits = dict(tokenizer=None, max_model_len=64, vocab_size=100, max_num_seqs=4, unbounded_length=False,
                  longest_token_chars=3)
    return RequestValidator(**{**limits, **overrides})


def test_max_tokens_defaults_to_the_room_left_and_may_not_exceed_it():
    assert validator().check_lengths([1] * 10, SamplingParams(max_tokens=None)) == 54
    assert validator().check_lengths([1] * 10, SamplingParams(max_tokens=54)) == 54
    with pytest.raises(ValueError, match=r"max_tokens=55 exceeds max_model_len=64 minus prompt length 10 "
                                         r"\(at most 54\)"):
        validator().check_lengths([1] * 10, SamplingParams(max_tokens=55))


def test_an_unbounded_engine_bounds_only_max_tokens():
    unbounded = validator(unbounded_length=True)
    assert unbounded.check_lengths([1] * 100, SamplingParams(max_tokens=None)) == 64
    assert unbounded.check_lengths([1] * 100, SamplingParams(max_tokens=500)) == 500
    assert unbounded.max_prompt_chars == float("inf")
    assert validator().max_prompt_chars == 64 * 3


def test_prompts_that_leave_no_room_or_leave_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="the prompt is empty"):
        validator().check_lengths([], SamplingParams())
    with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len=64 leaves no room"):
        validator().check_lengths([1] * 64, SamplingParams())
    with pytest.raises(ValueError, match=r"prompt token ids \[100, -1\] are outside the vocabulary \[0, 100\)"):
        validator().check_lengths([1, 100, -1], SamplingParams())
    with pytest.raises(ValueError, match=r"the prompt has 193 characters, more than max_model_len=64 tokens can "
                                         r"hold \(at most 192: the longest token has 3\)"):
        validator().check_prompt_chars(193)
    validator().check_prompt_chars(192)


def test_only_a_request_scoring_its_prompt_may_fill_max_model_len():
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    assert validator().check_lengths([1] * 64, scoring) == 1
    for params in [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2, prompt_logprobs=0),
                   SamplingParams(max_tokens=None, prompt_logprobs=0)]:
        with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len=64 leaves no room to "
                                             "generate \\(only a request scoring its prompt may fill it"):
            validator().check_lengths([1] * 64, params)
    with pytest.raises(ValueError, match=r"the prompt has 65 tokens, but max_model_len=64 leaves no room to "
                                         r"generate$"):
        validator().check_lengths([1] * 65, scoring)
    validator().check_prompt_length(64)  # the server's early check, before it knows the request's parameters


def test_stop_token_ids_outside_the_vocabulary_are_refused_naming_the_field():
    assert validator().check_lengths([1], SamplingParams(max_tokens=3, stop_token_ids=[0, 99])) == 3
    with pytest.raises(ValueError, match=r"^stop_token_ids \[100, -1\] are outside the vocabulary \[0, 100\)"):
        validator().check_lengths([1], SamplingParams(stop_token_ids=[5, 100, -1]))


def test_n_stop_strings_and_text_need_what_the_engine_has():
    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        validator().check_lengths([1], SamplingParams(n=5))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        validator().check_lengths([1], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="this model directory has no tokenizer"):
        validator().encode("hello")


def test_sampling_params_default_and_must_be_sampling_params():
    assert checked_params(None) == SamplingParams()
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams, got dict"):
        checked_params({"max_tokens": 3})
