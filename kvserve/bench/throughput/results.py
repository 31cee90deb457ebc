"""What one engine's timed run of `kvserve bench throughput` produced (RunResult) and how a kvserve engine multiplied
and stepped (Routes): the data the runners return and the report reads."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module, which must not import torch
    from kvserve.model.probe_shapes import WeightShapes


@dataclass(frozen=True)
class Routes:
    """How a kvserve row's engine multiplied its weights and ran its decode steps, read from the engine itself: what
    the decode split compares with the matmuls it replays."""
    float_matmul: object  # model/float_kernels.py: what multiplied float weights (int8 weights: F.linear, unused)
    int8_kernel: object | None  # model/int8_kernels.py: what multiplied int8 weights (None: float weights)
    compiled: bool  # --compile-decode: a graph was built for decode steps (compile/steps.py)
    gemms: bool  # ... with --compile-gemms applied (Inductor's GEMM template)
    one_row_loops: bool = False  # ... whose one-row steps multiply float weights or int8 codes in loops of its
    # own (Linears)
    shapes: WeightShapes | None = None  # the model's matrices, which the routes were probed on (probe_shapes.py)

    @classmethod
    def of(cls, engine) -> Routes:
        linears, compiled = engine.model.linears, engine.runner.compiled
        return cls(linears.matmul, linears.kernel, compiled is not None, compiled is not None and compiled.gemms,
                   compiled is not None and linears.one_row_loops, linears.shapes)


@dataclass(frozen=True)
class RunResult:
    name: str
    output_tokens: int
    seconds: float
    outputs: list[list[int]] | None = None
    decode_tokens: int = 0  # tokens sampled in steps that prefilled nothing ...
    decode_seconds: float = 0.0  # ... and the time of those steps (kvserve only)
    steps: Counter = field(default_factory=Counter)  # (tokens, sampled rows) -> steps of that shape (kvserve)
    prefill_tokens: int = 0  # prompt tokens computed, not found in the prefix cache (kvserve)
    draft_tokens: int = 0  # speculative decoding (kvserve): draft tokens verified ...
    accepted_tokens: int = 0  # ... accepted ...
    drafts: int = 0  # ... in this many verifications
    decode_steps: int = 0  # steps that prefilled nothing (kvserve) ...
    compiled_steps: int = 0  # ... and those of them that ran a compiled graph (--compile-decode)
    # the least the decode-only steps' attention reads: each sequence's K/V over its whole context once a step, in the
    # KV format's bytes a token (kvserve; every layer over every key: a sliding layer would read less)
    decode_kv_bytes: int = 0
    routes: Routes | None = None  # how its engine multiplied and ran decode steps (kvserve)
    prefill_steps: int = 0  # steps with prompt tokens (kvserve) ...
    compiled_prefill_steps: int = 0  # ... and those of them that ran a compiled graph
    # kvserve: the time of the steps with prompt tokens (prefill_tokens computed in them); transformers with
    # --phases: the time of generate() making one token (its prompts' tokens, unpadded, in prefill_tokens)
    prefill_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else None


def median_run(runs: list[RunResult]) -> RunResult:
    """The run of median tokens/s (the lower middle one of an even number)."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]


def agreement(a: RunResult, b: RunResult) -> float:
    """Fraction of requests whose greedy tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a.outputs, b.outputs)) / len(a.outputs)
