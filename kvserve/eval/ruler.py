"""RULER-lite: long-context retrieval tasks generated locally from a seed, in the manner of NVIDIA's RULER.

Each sample is a plain completion prompt of about `length` tokens (the model's own tokenizer): a haystack of
filler sentences with needles ("The special number for <key> is <value>.") at spread depths, the question at the
end and the start of the answer after it. The tasks, as RULER defines them:

- niah_single: one needle, asked for its value.
- niah_multikey: four needles with different keys; one key is asked for (the others distract).
- niah_multivalue: four needles with the same key; all four values are asked for.
- niah_multiquery: four needles with different keys; all four are asked for at once.
- vt (variable tracking): a chain "VAR A = 12345 ... VAR B = VAR A ..." hidden in the filler, after a short worked
  example (as RULER gives one); the answer names every variable that holds the value.

A sample's score is the share of its expected strings found in the greedy answer (RULER's string_match_all)."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")

FILLER = "The grass is green. The sky is blue. The sun is warm. Here we go. There and back again. "
FILLER_SENTENCES = [sentence + ". " for sentence in FILLER.removesuffix(". ").split(". ")]
INTRO = ("A long text follows, with a few special numbers hidden in it. Remember each number and what it belongs "
         "to: you will be asked for them at the end.\n\n")
NEEDLE = "\nThe special number for {key} is {value}.\n"
VT_INTRO = ("A long text follows, with variable assignments hidden in it. Follow the chain of assignments: you "
            "will be asked which variables hold a value. A short example first:\n"
            "VAR QQQQQ = 11111.\nThe sky is blue.\nVAR RRRRR = VAR QQQQQ.\nThe sun is warm.\nVAR SSSSS = VAR RRRRR.\n"
            "Which variables are assigned the value 11111, directly or through other variables? The variables "
            "assigned the value 11111 are: QQQQQ, RRRRR, SSSSS.\n\nNow the text.\n\n")
VT_LINE = "\nVAR {name} = {value}.\n"

_ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "happy", "icy", "jolly", "kind",
               "lucky", "misty", "noble", "odd", "proud", "quiet", "rapid", "shiny", "tidy", "vivid", "witty",
               "young", "zesty", "bold", "crisp", "fuzzy", "grand", "hollow", "loyal")
_NOUNS = ("apple", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "rabbit", "saddle", "tiger",
          "violin", "walrus", "yacht", "zebra", "basket", "castle", "dolphin", "forest", "guitar", "hammer")
NUM_NEEDLES = 4  # keys in multikey and multiquery, values in multivalue
VT_HOPS = 4  # a chain of 5 variables
# tokens generated beyond a perfect answer's (" v1, v2."): room for a short preamble, no more, since decode is
# what a sample costs most beyond its prefill
ANSWER_SLACK_TOKENS = 6


@dataclass(frozen=True)
class Layout:
    """What a task puts around and into the haystack: needle texts each with its depth in (0, 1)."""

    intro: str
    needles: list[tuple[float, str]]
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class RulerSample:
    task: str
    length: int  # the target prompt length in tokens (the prompt is at most this long)
    token_ids: list[int]
    answers: tuple[str, ...]  # every one should appear in the answer
    max_new_tokens: int


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = _key(rng)
        if key not in keys:
            keys.append(key)
    return keys


def _values(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def _single(rng: random.Random, depth: float) -> Layout:
    key, value = _key(rng), _values(rng, 1)[0]
    question = f"\nWhat is the special number for {key}? The special number for {key} is"
    return Layout(INTRO, [(depth, NEEDLE.format(key=key, value=value))], question, (value,))


def _multikey(rng: random.Random, depth: float) -> Layout:
    keys, values = _keys(rng, NUM_NEEDLES), _values(rng, NUM_NEEDLES)
    depths = [depth] + [rng.random() for _ in keys[1:]]
    needles = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    question = f"\nWhat is the special number for {keys[0]}? The special number for {keys[0]} is"
    return Layout(INTRO, needles, question, (values[0],))


def _multivalue(rng: random.Random, depth: float) -> Layout:
    key, values = _key(rng), _values(rng, NUM_NEEDLES)
    depths = [depth] + [rng.random() for _ in values[1:]]
    needles = [(d, NEEDLE.format(key=key, value=v)) for d, v in zip(depths, values)]
    question = (f"\nWhat are all the special numbers for {key}? The special numbers for {key} are")
    return Layout(INTRO, needles, question, tuple(values))


def _multiquery(rng: random.Random, depth: float) -> Layout:
    keys, values = _keys(rng, NUM_NEEDLES), _values(rng, NUM_NEEDLES)
    depths = [depth] + [rng.random() for _ in keys[1:]]
    needles = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
    asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    question = f"\nWhat are the special numbers for {asked}? The special numbers for {asked} are"
    return Layout(INTRO, needles, question, tuple(values))


def _vt(rng: random.Random, depth: float) -> Layout:
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    value = _values(rng, 1, digits=5)[0]
    lines = [VT_LINE.format(name=names[0], value=value)]
    lines += [VT_LINE.format(name=b, value=f"VAR {a}") for a, b in zip(names, names[1:])]
    depths = sorted([depth] + [rng.random() for _ in lines[1:]])
    question = (f"\nWhich variables are assigned the value {value}, directly or through other variables? "
                f"The variables assigned the value {value} are:")
    return Layout(VT_INTRO, list(zip(depths, lines)), question, tuple(names))


GENERATORS: dict[str, Callable[[random.Random, float], Layout]] = {
    "niah_single": _single, "niah_multikey": _multikey, "niah_multivalue": _multivalue,
    "niah_multiquery": _multiquery, "vt": _vt,
}


def _text(layout: Layout, num_sentences: int) -> str:
    """`num_sentences` filler sentences with each needle after the sentence nearest its depth."""
    by_slot: dict[int, list[str]] = {}
    for depth, needle in sorted(layout.needles):
        by_slot.setdefault(round(num_sentences * depth), []).append(needle)
    parts = [layout.intro]
    for slot in range(num_sentences + 1):
        parts.extend(by_slot.get(slot, []))
        if slot < num_sentences:
            parts.append(FILLER_SENTENCES[slot % len(FILLER_SENTENCES)])
    return "".join(parts) + layout.question


def fit(tokenizer, layout: Layout, length: int) -> list[int]:
    """The layout's prompt at most `length` tokens long, with as many filler sentences as fit (a binary search:
    a sentence's tokens depend on its neighbours)."""
    tokens = lambda n: tokenizer(_text(layout, n)).input_ids  # noqa: E731
    fixed = len(tokens(0))
    if fixed > length:
        raise ValueError(f"a {length}-token prompt cannot hold this task's instructions, needles and question "
                         f"({fixed} tokens); ask for longer prompts")
    low, high = 0, (length - fixed) // 3  # every filler sentence takes at least 3 tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if len(tokens(middle)) <= length else (low, middle - 1)
    return tokens(low)


def make_samples(tokenizer, task: str, length: int, num_samples: int, seed: int) -> list[RulerSample]:
    """`num_samples` prompts of one task, the asked needle at depths spread evenly over the text."""
    if task not in GENERATORS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"{seed}-{task}-{length}")
    samples = []
    for i in range(num_samples):
        layout = GENERATORS[task](rng, (i + 0.5) / num_samples)
        answer_tokens = len(tokenizer(" " + ", ".join(layout.answers) + ".", add_special_tokens=False).input_ids)
        samples.append(RulerSample(task, length, fit(tokenizer, layout, length), layout.answers,
                                   answer_tokens + ANSWER_SLACK_TOKENS))
    return samples


def score(answers: tuple[str, ...], output: str) -> float:
    """The share of expected strings found in the output, case-insensitively (RULER's string_match_all)."""
    text = output.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)
