"""RULER-lite through each setting's engine, and its scores summed up against the reference (the first setting).

A (task, length) the reference scores below PASS_THRESHOLD is one the model cannot do even with the full cache: it
is reported but left out of every setting's average, so the average measures what a setting loses, not what the
model never had."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.eval.ruler import RulerSample, make_samples, score
from kvserve.sampling_params import SamplingParams

PASS_THRESHOLD = 0.6
MIN_RULER_LENGTH = 256  # room for the instructions, the needles and the question


@dataclass(frozen=True)
class RulerPlan:
    """Which tasks, at which prompt lengths, how many samples of each, drawn from which seed."""

    tasks: list[str]
    lengths: list[int]
    samples: int
    seed: int

    def make_samples(self, tokenizer) -> dict[int, list[RulerSample]]:
        return {n: [s for task in self.tasks for s in make_samples(tokenizer, task, n, self.samples, self.seed)]
                for n in self.lengths}

    def header(self) -> dict:
        return {"ruler_tasks": self.tasks, "ruler_lengths": self.lengths, "ruler_samples": self.samples,
                "ruler_seed": self.seed, "ruler_pass_threshold": PASS_THRESHOLD}


@dataclass
class RulerScores:
    """One setting's mean score per length and task; a length the engine cannot hold is in `why` instead."""

    by_length: dict[int, dict[str, float]] = field(default_factory=dict)
    why: dict[int, str] = field(default_factory=dict)

    def average(self, included: list[tuple[int, str]]) -> float | None:
        """Mean over the included (length, task) pairs; None if this setting has none of them."""
        values = [self.by_length[n][task] for n, task in included if task in self.by_length.get(n, {})]
        return sum(values) / len(values) if values and len(values) == len(included) else None

    def to_json(self) -> dict[str, dict[str, float]]:
        return {str(n): dict(tasks) for n, tasks in self.by_length.items()}


def sample_scores(llm, samples: list[RulerSample]) -> list[float]:
    """Each sample's score from its greedy answer; all samples batched in one call through the engine."""
    params = [SamplingParams(max_tokens=s.max_new_tokens, temperature=0.0) for s in samples]
    outputs = llm.generate([s.token_ids for s in samples], params)
    return [score(s.answers, o.outputs[0].text) for s, o in zip(samples, outputs)]


def run_length(llm, samples: list[RulerSample], scores: RulerScores) -> None:
    """Score one length's samples (every task) and record each task's mean in `scores`."""
    length = samples[0].length
    if length + max(s.max_new_tokens for s in samples) > llm.engine.max_model_len:
        scores.why[length] = "n/a: longer than max_model_len"
        return
    by_task: dict[str, list[float]] = {}
    for sample, value in zip(samples, sample_scores(llm, samples)):
        by_task.setdefault(sample.task, []).append(value)
    scores.by_length[length] = {task: sum(v) / len(v) for task, v in by_task.items()}


def included_pairs(reference: RulerScores) -> list[tuple[int, str]]:
    """The (length, task) pairs the reference passes: the ones every setting's average is taken over."""
    return [(n, task) for n, tasks in reference.by_length.items() for task, value in tasks.items()
            if value >= PASS_THRESHOLD]


def excluded_pairs(reference: RulerScores) -> list[tuple[int, str]]:
    return [(n, task) for n, tasks in reference.by_length.items() for task, value in tasks.items()
            if value < PASS_THRESHOLD]


def print_ruler_tables(labels: list[str], results: list[RulerScores], plan: RulerPlan) -> None:
    """One table per length (a column per task; a task the reference fails in brackets), then the averages."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    included = included_pairs(results[0])
    for n in plan.lengths:
        table = Table(title=f"RULER-lite, {n:,}-token prompts, {plan.samples} per task, seed {plan.seed}")
        for column in ("setting", *plan.tasks, "average", "vs reference"):
            table.add_column(column, justify="left" if column == "setting" else "right")
        length_included = [pair for pair in included if pair[0] == n]
        for label, result in zip(labels, results):
            if n in result.why:
                table.add_row(label, result.why[n], *[""] * (len(plan.tasks) + 1))
                continue
            cells = [_task_cell(result, results[0], n, task) for task in plan.tasks]
            table.add_row(label, *cells, *_average_cells(result, results[0], length_included))
        console.print(table)
    if len(plan.lengths) > 1:
        table = Table(title="RULER-lite over all lengths")
        for column in ("setting", "average", "vs reference"):
            table.add_column(column, justify="left" if column == "setting" else "right")
        for label, result in zip(labels, results):
            table.add_row(label, *_average_cells(result, results[0], included))
        console.print(table)
    excluded = excluded_pairs(results[0])
    if excluded:
        console.print(f"in brackets and left out of the averages, as the reference scores below {PASS_THRESHOLD:.0%}: "
                      + ", ".join(f"{task} at {n:,}" for n, task in excluded))


def _task_cell(result: RulerScores, reference: RulerScores, n: int, task: str) -> str:
    value = result.by_length[n][task]
    passing = reference.by_length.get(n, {}).get(task, 0.0) >= PASS_THRESHOLD
    return f"{value:.0%}" if passing else f"({value:.0%})"


def _average_cells(result: RulerScores, reference: RulerScores, included: list[tuple[int, str]]) -> list[str]:
    mine, theirs = result.average(included), reference.average(included)
    relative = f"{mine / theirs:.1%}" if mine is not None and theirs else "n/a"
    return [_fmt(mine), relative]


def _fmt(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "n/a"
