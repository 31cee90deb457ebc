"""Incremental detokenization: the text equals decoding all tokens, a stop string and what follows it never
appear, and streamed text (stable_text) only ever grows, also across partial UTF-8 characters."""
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvserve.engine.detokenizer import MAX_PENDING_TOKENS, Detokenizer
from tests.conftest import char_tokenizer

def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte: a multi-byte character arrives over several tokens."""
    vocab = {char: i for i, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.fixture(scope="module")
def chars():
    return char_tokenizer()


def stream(detok: Detokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time as the engine does; the stable text after each."""
    shown = []
    for n in range(1, len(token_ids) + 1):
        detok.update(token_ids[:n])
        shown.append(detok.stable_text(finished=detok.stop_hit is not None or n == len(token_ids)))
        if detok.stop_hit is not None:
            break
    return shown


def assert_only_grows(shown: list[str]) -> None:
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before), f"streamed {before!r}, then took it back: {after!r}"


def test_text_is_the_decoded_output(chars):
    text = "héllo, wörld Ωμ!\n"
    detok = Detokenizer(chars)
    shown = stream(detok, chars.encode(text))
    assert detok.text == shown[-1] == text
    assert_only_grows(shown)


def test_stop_string_across_tokens_is_cut_with_what_follows(chars):
    detok = Detokenizer(chars, stop=["END"])
    shown = stream(detok, chars.encode("one two ENDthree"))
    assert detok.stop_hit == "END"
    assert detok.text == shown[-1] == "one two "
    assert len(shown) == len("one two END")  # found on the token that completes it
    assert_only_grows(shown)


def test_earliest_stop_string_wins(chars):
    detok = Detokenizer(chars, stop=["cde", "bc"])
    stream(detok, chars.encode("abcdef"))
    assert (detok.stop_hit, detok.text) == ("bc", "a")


def test_stop_string_arriving_in_one_token_is_found(chars):
    detok = Detokenizer(chars, stop=["!"])
    stream(detok, chars.encode("hi! there"))
    assert (detok.stop_hit, detok.text) == ("!", "hi")


def test_unfinished_text_holds_back_a_possible_stop_prefix(chars):
    detok = Detokenizer(chars, stop=["STOP"])
    detok.update(chars.encode("abcdefST"))
    assert detok.stable_text(finished=False) == "abcde"  # "fST" could still become "STOP"
    assert detok.stable_text(finished=True) == "abcdefST"


@pytest.mark.parametrize("stop", [["a much longer stop string"], ["z", "a much longer stop string"]])
def test_streamed_text_never_takes_characters_back_with_a_long_stop(chars, stop):
    detok = Detokenizer(chars, stop=stop)
    shown = stream(detok, chars.encode("short text, then a little more of it"))
    assert_only_grows(shown)
    assert shown[-1] == "short text, then a little more of it"


def test_partial_utf8_characters_are_held_back():
    tokenizer = byte_tokenizer()
    text = "a€b😀 ok"
    token_ids = tokenizer.encode(text)
    assert len(token_ids) == len(text.encode())  # really one token per byte
    detok = Detokenizer(tokenizer)
    shown = stream(detok, token_ids)
    assert not any("\ufffd" in s for s in shown)
    assert_only_grows(shown)
    assert shown[-1] == text
    assert shown[1] == "a" and shown[3] == "a€"  # "€" is 3 bytes: nothing new until the last


def test_special_tokens_are_skipped_unless_asked(chars):
    eos = chars.eos_token_id
    ids = chars.encode("hi") + [eos]
    skipped, kept = Detokenizer(chars), Detokenizer(chars, skip_special_tokens=False)
    skipped.update(ids)
    kept.update(ids)
    assert (skipped.text, kept.text) == ("hi", "hi</s>")


def test_without_a_tokenizer_there_is_no_text():
    detok = Detokenizer(None, stop=["x"])
    detok.update([1, 2, 3])
    assert (detok.text, detok.stop_hit, detok.stable_text(finished=True)) == ("", None, "")


@pytest.fixture(scope="module")
def smollm2():
    """The embedded model's byte-level BPE tokenizer: merges, multi-byte characters split across tokens."""
    from transformers import AutoTokenizer

    from kvserve.model.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None).path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8"), max_size=80))
def test_text_streamed_token_by_token_equals_decoding_it_all(smollm2, text):
    token_ids = smollm2.encode(text, add_special_tokens=False)
    assume(smollm2.decode(token_ids) == text)  # some unassigned code points do not survive the round trip
    detok = Detokenizer(smollm2)
    shown = stream(detok, token_ids)
    assert detok.text == smollm2.decode(token_ids, skip_special_tokens=True)
    assert_only_grows(shown)


class CountingTokenizer:
    """Counts the tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.num_decoded = tokenizer, 0

    def decode(self, token_ids, **kwargs):
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_token_costs_the_same_however_long_the_output(smollm2):
    # Decoding the whole output every step cost n^2/2 token decodes (half the step time at 7K tokens).
    token_ids = smollm2.encode("The KV cache keeps keys and values of past tokens, é ü 漢字 😀. " * 100)
    counting = CountingTokenizer(smollm2)
    detok = Detokenizer(counting, stop=["never appears"])
    stream(detok, token_ids)
    assert detok.text == smollm2.decode(token_ids)
    assert counting.num_decoded <= 8 * len(token_ids)


def test_invalid_bytes_are_let_through_instead_of_waiting_forever():
    tokenizer = byte_tokenizer()
    invalid = tokenizer.convert_tokens_to_ids(["ÿ"])  # the byte 0xFF, never valid in UTF-8
    counting = CountingTokenizer(tokenizer)
    detok = Detokenizer(counting)
    token_ids = invalid * 400 + tokenizer.encode("ok")
    stream(detok, token_ids)
    assert detok.text.endswith("ok") and "\ufffd" in detok.text
    assert counting.num_decoded <= 4 * MAX_PENDING_TOKENS * len(token_ids)  # not ~400^2 / 2
