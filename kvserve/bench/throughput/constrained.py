"""Constrained requests mixed into the decode-heavy workload (`kvserve bench throughput --constrained-share F`): the
same prompts run twice back to back on one engine, unconstrained and with a share F of them JSON-schema constrained,
the unconstrained run first in even rounds (the first is round 0) and second in odd ones, so that neither always
runs warmer or later than the other; printed: the tokens/s of the mix over the unconstrained run, round by round,
and the schema's grammar compile time (the first, and a cached one). Longer runs (--output-len) and more rounds
(--repeat, an even number) weigh the noise down. The schema holds at least `output_len` integers, each at least one
token, so a constrained request is never complete before its `output_len` tokens: both runs decode the same number
of tokens."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from kvserve.bench.throughput.results import RunResult
from kvserve.sampling_params import StructuredOutputsParams


def long_schema(output_len: int) -> dict:
    """A JSON schema whose shortest document is longer than `output_len` tokens."""
    return {"type": "object", "required": ["values"], "additionalProperties": False,
            "properties": {"values": {"type": "array", "minItems": output_len,
                                      "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}


def constrained_rows(num_requests: int, share: float) -> list[bool]:
    """Which requests are constrained: `share` of them, spread evenly."""
    return [int((i + 1) * share) > int(i * share) for i in range(num_requests)]


@dataclass
class ConstrainedMix:
    """Each configuration's (unconstrained, mixed) pairs, one per round, and its grammar's compile times."""

    share: float
    pairs: dict[str, list[tuple[RunResult, RunResult]]] = field(default_factory=dict)
    compile_s: dict[str, tuple[float, float]] = field(default_factory=dict)

    def run(self, llm, prompts: list[list[int]], output_len: int, config_name: str, run_kvserve, reset) -> None:
        spec = StructuredOutputsParams(json=long_schema(output_len))
        if config_name not in self.compile_s:  # each configuration's engine is new: its first compile is real
            start = time.perf_counter()
            llm.engine.grammar(spec)
            first = time.perf_counter() - start
            start = time.perf_counter()
            llm.engine.grammar(spec)
            self.compile_s[config_name] = (first, time.perf_counter() - start)
        structured = [spec if on else None for on in constrained_rows(len(prompts), self.share)]
        runs = {config_name: None, f"{config_name}, {self.share:.0%} constrained": structured}
        order = list(runs) if len(self.pairs.get(config_name, [])) % 2 == 0 else list(runs)[::-1]
        results = {}
        for name in order:
            reset(llm)
            results[name] = run_kvserve(llm, prompts, output_len, name, runs[name])
        plain, mixed = (results[name] for name in runs)
        self.pairs.setdefault(config_name, []).append((plain, mixed))

    def print(self, console) -> None:
        console.print(f"constrained mix: {self.share:.0%} of the decode-heavy requests JSON-schema constrained, run "
                      "beside the same requests unconstrained on the same engine (which runs first alternates round "
                      "by round, unconstrained first in the first); tokens/s of the mix ÷ unconstrained, each round "
                      "(median; the tokens/s are the median round's); the schema's grammar compile time, first and "
                      "cached")
        for name, pairs in self.pairs.items():
            ratios = [mixed.tokens_per_s / plain.tokens_per_s for plain, mixed in pairs]
            by_ratio = sorted(pairs, key=lambda pair: pair[1].tokens_per_s / pair[0].tokens_per_s)
            plain, mixed = by_ratio[len(by_ratio) // 2]
            first, cached = self.compile_s[name]
            console.print(f"  {name}: {plain.tokens_per_s:,.1f} → {mixed.tokens_per_s:,.1f} tokens/s; "
                          f"{', '.join(f'{r:.3f}x' for r in ratios)} ({statistics.median(ratios):.3f}x); "
                          f"compile {first * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
