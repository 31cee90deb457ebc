"""RULER-lite prompts: the same for a seed, at most the asked length and close to it, every expected answer in the
text where the task puts it, the question at the end; the scorer gives the share of expected strings found."""
import pytest

from kvserve.eval.ruler import TASKS, make_samples, score
from tests.conftest import char_tokenizer

TOLERANCE_TOKENS = 24  # the char tokenizer: one token per character; one filler sentence


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_the_same_for_a_seed_and_differ_across_seeds(tokenizer, task):
    first = make_samples(tokenizer, task, 1500, 3, seed=0)
    assert make_samples(tokenizer, task, 1500, 3, seed=0) == first
    assert make_samples(tokenizer, task, 1500, 3, seed=1) != first
    assert len({s.answers for s in first}) == 3  # each sample asks for its own values


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1200, 3000])
def test_prompts_land_just_under_the_asked_length(tokenizer, task, length):
    for sample in make_samples(tokenizer, task, length, 4, seed=2):
        assert length - TOLERANCE_TOKENS <= len(sample.token_ids) <= length
        assert sample.length == length and sample.task == task


def test_needle_tasks_hide_each_value_once_and_ask_for_the_right_key(tokenizer):
    for task, expected in [("niah_single", 1), ("niah_multikey", 1), ("niah_multivalue", 4), ("niah_multiquery", 4)]:
        for sample in make_samples(tokenizer, task, 1500, 3, seed=3):
            text = tokenizer.decode(sample.token_ids)
            assert len(sample.answers) == expected
            for value in sample.answers:
                assert text.count(value) == 1
                key = text[: text.index(value)].rsplit("The special number for ", 1)[1].removesuffix(" is ")
                assert key in text[text.rindex("\n"):]  # the question names the key its value belongs to
            assert text.endswith(" is") or text.endswith(" are")


def test_multikey_distractors_have_other_keys_and_values(tokenizer):
    sample = make_samples(tokenizer, "niah_multikey", 1500, 1, seed=4)[0]
    text = tokenizer.decode(sample.token_ids)
    needles = [line for line in text.splitlines() if line.startswith("The special number for ")]
    assert len(needles) == 4 and len({line.split()[4] for line in needles}) == 4
    question = text.splitlines()[-1]
    assert sum(line.split()[4] in question for line in needles) == 1


def test_the_asked_needle_moves_deeper_sample_by_sample(tokenizer):
    samples = make_samples(tokenizer, "niah_single", 2000, 4, seed=5)
    places = [tokenizer.decode(s.token_ids).index(s.answers[0]) for s in samples]
    assert places == sorted(places) and places[-1] - places[0] > 1000


def test_variable_tracking_chains_every_answer_to_the_value(tokenizer):
    for sample in make_samples(tokenizer, "vt", 1500, 3, seed=6):
        text = tokenizer.decode(sample.token_ids)
        assignments = dict(line[4:-1].split(" = ") for line in text.splitlines() if line.startswith("VAR "))
        value = text.splitlines()[-1].split("the value ")[1].split(",")[0]
        holding = {name for name in assignments if _resolve(assignments, name) == value}
        assert holding == set(sample.answers) and len(holding) == 5


def _resolve(assignments: dict[str, str], name: str) -> str:
    value = assignments[name]
    return _resolve(assignments, value[4:]) if value.startswith("VAR ") else value


def test_score_is_the_share_of_expected_strings_found():
    assert score(("1234567",), " 1234567.") == 1.0
    assert score(("1234567",), " 123456.") == 0.0
    assert score(("111", "222", "333", "444"), "222, 111, 999") == 0.5
    assert score(("ABCDE", "FGHIJ"), " abcde and fghij") == 1.0


def test_a_length_too_short_for_the_task_is_refused(tokenizer):
    with pytest.raises(ValueError, match="ask for longer prompts"):
        make_samples(tokenizer, "niah_multiquery", 300, 1, seed=0)
    with pytest.raises(ValueError, match="unknown RULER task 'qa'"):
        make_samples(tokenizer, "qa", 1000, 1, seed=0)
