"""Passkey retrieval: a random 5-digit key hidden at some depth in filler text, asked for at the end.

The model sees a plain completion prompt (no chat template) and answers greedily; a trial passes when the key's
digits appear in its first few tokens. Depths are spread evenly over (0, 1) across trials; keys come from the seed."""
from __future__ import annotations

import random
from dataclasses import dataclass

INTRO = "A pass key is hidden somewhere in the long text below. Find it and keep it in mind: you will be asked for it.\n\n"
FILLER = "The river runs past the old mill. Clouds drift over the quiet hills. A dog sleeps in the sun. "
NEEDLE = "\nThe pass key is {key}. Keep it in mind. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class PasskeyTrial:
    length: int  # target prompt length in tokens (the prompt is at most this long)
    key: str
    depth: float  # where the needle sits in the filler, 0 = start, 1 = end
    token_ids: list[int]


def make_trial(tokenizer, length: int, depth: float, key: str) -> PasskeyTrial:
    """A prompt of at most `length` tokens (and within 100 tokens of it) with the key at `depth`."""
    filler_tokens = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    fixed = len(tokenizer(INTRO + NEEDLE.format(key=key) + QUESTION).input_ids)
    repeats = max(0, (length - fixed) // filler_tokens)
    while True:
        before = round(repeats * depth)
        text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (repeats - before) + QUESTION
        token_ids = tokenizer(text).input_ids
        if len(token_ids) <= length or repeats == 0:
            return PasskeyTrial(length, key, depth, token_ids)
        repeats -= 1


def make_trials(tokenizer, length: int, num_trials: int, seed: int) -> list[PasskeyTrial]:
    rng = random.Random(f"{seed}-{length}")
    return [make_trial(tokenizer, length, (i + 0.5) / num_trials, f"{rng.randrange(10_000, 100_000)}")
            for i in range(num_trials)]


def passed(trial: PasskeyTrial, answer: str) -> bool:
    return trial.key in answer.replace(",", "").replace(" ", "")
