"""Why and where generation stops, end to end on a tiny model with a one-char-per-token tokenizer: stop strings
(cut from the text), stop_token_ids, EOS unless ignore_eos, max_tokens; and streamed text never shrinks."""
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.conftest import save_char_tokenizer

PROMPT = "The quick brown fox"
MAX_TOKENS = 24


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_char_tokenizer(make_tiny_model(tmp_path_factory.mktemp("stops"), "llama-gqa"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=128)


@pytest.fixture(scope="module")
def reference(llm):
    """The unstopped greedy continuation."""
    out = llm.generate(PROMPT, greedy())[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
    assert len(set(out.text)) > 8, "the tiny model should produce varied text for these tests to mean anything"
    return out


def test_max_tokens_finishes_with_length(llm, reference):
    out = llm.generate(PROMPT, greedy(max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == reference.token_ids[:5]
    assert out.text == llm.tokenizer.decode(reference.token_ids[:5], skip_special_tokens=True)


@pytest.mark.parametrize("start, length", [(6, 3), (0, 1), (15, 4)])
def test_stop_string_is_cut_from_the_text(llm, reference, start, length):
    stop = reference.text[start : start + length]
    out = llm.generate(PROMPT, greedy(stop=[stop]))[0].outputs[0]
    at = reference.text.find(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == reference.text[:at]
    assert stop not in out.text
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]  # generation ends on the token completing it
    assert llm.tokenizer.decode(out.token_ids, skip_special_tokens=True).endswith(stop)


def test_stop_string_that_never_appears_changes_nothing(llm, reference):
    out = llm.generate(PROMPT, greedy(stop=["\u2603 never generated"]))[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (reference.text, reference.token_ids, "length")


def test_stop_string_in_the_prompt_does_not_stop(llm, reference):
    out = llm.generate(PROMPT, greedy(stop=["quick"]))[0].outputs[0]
    assert out.finish_reason == "length" and out.text == reference.text


def test_stop_token_id_ends_generation_on_it(llm, reference):
    stop_id = reference.token_ids[5]
    first = reference.token_ids.index(stop_id)
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == reference.token_ids[: first + 1]


def test_eos_stops_unless_ignore_eos(tmp_path, reference):
    eos = reference.token_ids[4]
    first = reference.token_ids.index(eos)
    # same weights (same seed), only the EOS id differs
    eos_dir = save_char_tokenizer(make_tiny_model(tmp_path, "llama-gqa", eos_token_id=eos))
    llm = LLM(str(eos_dir), kv_cache_memory="1MiB", max_model_len=128)

    stopped = llm.generate(PROMPT, greedy(ignore_eos=False))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == eos
    assert stopped.token_ids == reference.token_ids[: first + 1]

    ignored = llm.generate(PROMPT, greedy(ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == reference.token_ids


@pytest.mark.parametrize("stop", [[], ["\u2603 never seen"], None])  # held back: 11 chars of a 24-char run
def test_streamed_text_never_takes_characters_back(llm, reference, stop):
    stop = stop if stop is not None else [reference.text[10:13]]
    engine = llm.engine
    engine.add_request("stream", PROMPT, greedy(stop=stop))
    shown = [""]
    while engine.has_unfinished_requests():
        for output in engine.step():
            shown.append(output.outputs[0].text)
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before), f"streamed {before!r}, then {after!r}"
    final = llm.generate(PROMPT, greedy(stop=stop))[0].outputs[0].text
    assert shown[-1] == final
