"""The matrices a model multiplies, as the start-up matmul probes time them (float_kernels.py, int8_kernels.py).

A route's speed against another depends on the shapes it multiplies (a 576-wide layer and a 4096-wide one read
their weights differently), so each probe times the routes on the shapes of the model being loaded, weighted by how
many weights of each shape it holds, and the choice is remembered under those shapes (route_cache.py). The shapes
are the checkpoint's matrices as it holds them (q, k and v separately: the decoders fuse some of them at load) and,
when the embedding is tied, the embedding table as the output head. Only the shapes holding most of the bytes are
timed, each on as many distinct weights as fill PROBE_BYTES (a slice of a larger weight: its time scaled by its rows),
so that a probe reads its weights from memory as a decode step does, and takes the same short time for every model.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

PROBE_BYTES = 32 << 20  # per shape timed: more than a 2-core slice's cache holds
TIMED_SHARE = 0.9  # the largest shapes holding this share of the model's weight bytes are timed ...
MAX_TIMED = 4  # ... up to this many


@dataclass(frozen=True)
class ProbedShape:
    """One shape as a probe times it: `copies` weights of `rows` x `cols`, whose time times `scale` is the time of
    the model's weights of that shape."""

    rows: int
    cols: int
    copies: int
    scale: float


@dataclass(frozen=True)
class WeightShapes:
    """(out features, in features, how many weights of that shape), the most bytes first."""

    counts: tuple[tuple[int, int, int], ...]

    @classmethod
    def of_weights(cls, weights: dict[str, torch.Tensor], tied: bool,
                   embedding: str = "model.embed_tokens.weight") -> WeightShapes:
        """The matrices among a decoder's weights; the embedding table counts as the output head only when tied
        (otherwise it is looked up, and the head is a matrix of its own)."""
        counts: dict[tuple[int, int], int] = {}
        for name, tensor in weights.items():
            if tensor.dim() == 2 and (tied or name != embedding):
                counts[tuple(tensor.shape)] = counts.get(tuple(tensor.shape), 0) + 1
        if not counts:
            raise ValueError("a model without matrices has no matmul route to probe")
        return cls(tuple(sorted(((n, k, c) for (n, k), c in counts.items()), key=lambda s: (-s[0] * s[1] * s[2],
                                                                                            s))))

    def key(self) -> list[list[int]]:
        """As the route file holds it: what the remembered choice was probed on."""
        return [list(s) for s in self.counts]

    def timed(self, element_size: int) -> list[ProbedShape]:
        """The shapes a probe times, for weights of `element_size` bytes an element."""
        total = sum(n * k * c for n, k, c in self.counts)
        timed, covered = [], 0
        for n, k, count in self.counts[:MAX_TIMED]:
            rows = min(n, max(1, PROBE_BYTES // (k * element_size)))
            copies = min(count, math.ceil(PROBE_BYTES / (rows * k * element_size)))
            timed.append(ProbedShape(rows, k, copies, count * n / (rows * copies)))
            covered += n * k * count
            if covered >= TIMED_SHARE * total:
                break
        return timed


def token_time(timed: list[ProbedShape], weights: list[list], inputs: list[torch.Tensor],
               multiply: Callable[[torch.Tensor, object], torch.Tensor]) -> float:
    """Seconds the model's weights of the timed shapes take by `multiply(x, weight)`: each shape's `weights` (its
    copies) called in turn on its input, the best of a few rounds, scaled to the model's count."""
    return sum(shape.scale * best_time(lambda: [multiply(x, w) for w in copies])
               for shape, copies, x in zip(timed, weights, inputs))


def best_time(fn, reps: int = 5) -> float:
    fn()  # the first call may pack or allocate
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# what a probe times when no model is named (bench's roofline, the kernels' tests): an MLP-sized weight
FIXED = WeightShapes(((2048, 1024, 4),))
