"""The machine's own matmul rate for a workload, to say what share of "what this CPU can do" an engine reaches.

An engine run records each step's shape: tokens through the layers, rows through the output head. The same
matmuls (the model's linear shapes, float32 on random weights, no attention, no Python around them, multiplied as
the engine multiplies float32 weights in this process: F.linear, or oneDNN's linear over packed copies where the
start-up probe chose it, kvserve/model/float_kernels.py) are replayed and timed here, in the same process and
run; the workload's matmul FLOPs divided by that time is the roofline an engine's achieved rate is compared with.
Every layer has weights of its own, as the model does: a step of one token reads them all from memory, which is what
bounds a single stream (with one set of weights shared by the layers, 14 MB for SmolLM2, the replay would read them
from the CPU's cache)."""
from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig
from kvserve.model import float_kernels
from kvserve.model.probe_shapes import FIXED, WeightShapes

StepShapes = Counter  # (tokens through the layers, rows through the head) -> number of such steps


@dataclass(frozen=True)
class MatmulShapes:
    """A decoder's linear layers as [out, in] shapes: the ones every token goes through, and the head."""

    per_layer: tuple[tuple[int, int], ...]
    num_layers: int
    head: tuple[int, int]

    @classmethod
    def of(cls, cfg: ModelConfig) -> MatmulShapes:
        q, kv, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
        per_layer = ((q + 2 * kv, hidden), (hidden, q), (2 * cfg.intermediate_size, hidden),
                     (hidden, cfg.intermediate_size))
        return cls(per_layer, cfg.num_layers, (cfg.vocab_size, hidden))

    def flops(self, tokens: int, head_rows: int) -> int:
        layer_params = sum(n * k for n, k in self.per_layer) * self.num_layers
        return 2 * tokens * layer_params + 2 * head_rows * self.head[0] * self.head[1]


def workload_flops(shapes: MatmulShapes, steps: StepShapes) -> int:
    return sum(shapes.flops(tokens, rows) * count for (tokens, rows), count in steps.items())


def decode_steps(steps: StepShapes) -> StepShapes:
    """The steps that only decoded: every token through the layers is a sampled row (no prompt token, no draft)."""
    return Counter({shape: count for shape, count in steps.items() if shape[0] == shape[1]})


def matmul_seconds(shapes: MatmulShapes, steps: StepShapes, reps: int = 2, matmul=None) -> float:
    """Seconds float32 matmuls take to replay `steps`, each layer with weights of its own, multiplied by `matmul`
    (by default replay_matmul's)."""
    return replayed_seconds(step_seconds(shapes, steps, reps, matmul), steps)


def replayed_seconds(per_step: dict[tuple[int, int], float], steps: StepShapes) -> float:
    """`steps`' replayed time from step_seconds' per-shape times (which must cover every shape of `steps`)."""
    return sum(count * per_step[shape] for shape, count in steps.items())


def step_seconds(shapes: MatmulShapes, steps: StepShapes, reps: int = 2,
                 matmul=None) -> dict[tuple[int, int], float]:
    """Seconds one step of each of `steps`' shapes takes in float32 matmuls (matmul_seconds, shape by shape): a
    workload's replay and any subset of its steps (its decode steps) from one timing."""
    gen = torch.Generator().manual_seed(0)
    matmul = matmul or replay_matmul()

    def weight(n: int, k: int) -> tuple[torch.Tensor | None, object]:
        w = torch.empty(n, k).uniform_(-1, 1, generator=gen)
        packed = matmul.pack(w)
        return (w if packed is None else None), packed  # a packed copy replaces the weight, as in the engine

    layers = [[weight(n, k) for n, k in shapes.per_layer] for _ in range(shapes.num_layers)]
    head = weight(*shapes.head)
    seconds = {}
    for tokens, rows in steps:
        inputs = [torch.randn(tokens, n_in, generator=gen) for _, n_in in shapes.per_layer]
        head_in = torch.randn(rows, shapes.head[1], generator=gen)

        def step() -> None:
            for weights in layers:
                for (w, packed), xi in zip(weights, inputs):
                    matmul.linear(xi, w, packed, None)
            matmul.linear(head_in, *head, None)

        seconds[tokens, rows] = _best_time(step, reps)
    return seconds


def share_ceiling(matmul_seconds: float, decode_matmul_seconds: float, decode_kv_seconds: float,
                  prompt_seconds: float | None = None) -> float:
    """The most a run's matmuls (`matmul_seconds` replayed, `decode_matmul_seconds` of them its decode-only steps')
    can be of its time when its decode-only steps take their matmuls plus one read of their K/V
    (`decode_kv_seconds`) and nothing else, and its steps with prompt tokens `prompt_seconds`: None for their
    replayed matmuls (the ceiling if they too ran at the matmuls' rate), the time they took in a run for the
    ceiling its prompt steps as they ran leave."""
    if prompt_seconds is None:
        prompt_seconds = matmul_seconds - decode_matmul_seconds
    return matmul_seconds / (prompt_seconds + decode_matmul_seconds + decode_kv_seconds)


@functools.cache
def read_bandwidth(nbytes: int = 2**30, reps: int = 10) -> float:
    """Bytes/s this CPU reads from memory with every core: the best of `reps` sums over `nbytes` of float32 (far more
    than its caches hold), what a decode step reading its weights or a K/V cache once can at best reach. Measured
    once a process; on a shared machine it varies with the neighbours' traffic, and the best of many sums is the least
    disturbed."""
    data = torch.ones(nbytes // 4)
    return nbytes / _best_time(data.sum, reps)


def replay_matmul(weights: WeightShapes | None = None):
    """The route that multiplies float32 weights of a model of `weights`' shapes (None: the probe's fixed ones) in
    this process (model/float_kernels.py: the probe's choice)."""
    return float_kernels.choose_matmul(torch.float32, weights or FIXED)


def _best_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
