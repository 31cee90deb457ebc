"""Passkey prompts: at most the asked length and close to it, the key in the text once per needle sentence, at
the asked depth; a trial passes when the key's digits come back."""
from kvserve.eval.passkey import make_trials, passed
from tests.conftest import char_tokenizer


def test_trials_hide_their_key_at_spread_depths_within_the_length():
    tokenizer = char_tokenizer()
    trials = make_trials(tokenizer, 600, 4, seed=0)
    assert [t.depth for t in trials] == [0.125, 0.375, 0.625, 0.875]
    assert len({t.key for t in trials}) == 4 and all(len(t.key) == 5 for t in trials)
    for t in trials:
        assert 500 < len(t.token_ids) <= 600
        text = tokenizer.decode(t.token_ids)
        assert text.count(t.key) == 2 and text.endswith("The pass key is")
    early, late = (tokenizer.decode(t.token_ids).index(t.key) for t in (trials[0], trials[-1]))
    assert early < late
    assert make_trials(tokenizer, 600, 4, seed=0) == trials  # the seed decides the keys


def test_an_answer_passes_when_it_contains_the_key():
    trial = make_trials(char_tokenizer(), 300, 1, seed=1)[0]
    assert passed(trial, f" {trial.key}.") and passed(trial, f"{trial.key[:2]},{trial.key[2:]}")
    assert not passed(trial, "12")
