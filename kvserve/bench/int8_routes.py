"""The int8 matmul routes side by side on SmolLM2-135M's shapes: `python -m kvserve.bench.int8_routes`.

Each route multiplies int8 codes by int8 weights into float32 sums (kvserve/model/int8_kernels.py), so they differ
only in speed. A "token" here is what one decode step multiplies: every layer's fused q/k/v, o, fused gate/up and
down weights, each layer with weights of its own (the step reads them all from memory, as the model's does), and the
output head. Routes are timed in interleaved rounds in one process (a busy machine slows them alike), and each is
reported as the reference route's time over its own, per token and per shape at one row. `--inductor-template`
adds what --compile-gemms does, per shape: oneDNN's op over weights frozen into a graph of their own, which
Inductor lowers to its C++ GEMM template (AMX micro-kernels where the CPU has them): the compile and the calls."""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from kvserve.compile.inductor import freezing, quiet_autotuning
from kvserve.compile.steps import GEMM_OPTIONS
from kvserve.model.int8_kernels import KERNELS, FloatKernel, Int8Kernel, OneDNNKernel
from kvserve.model.probe_shapes import best_time

# SmolLM2-135M's linears as [out, in]: q/k/v fused, o, gate/up fused, down; 30 layers; the tied head
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30
HEAD_SHAPE = (49152, 576)
ROWS = (1, 2, 8, 32)


def routes() -> list[Int8Kernel]:
    """Every route available on this CPU: the probe's kernels and float32."""
    return [kernel for kernel in KERNELS if kernel.available()] + [FloatKernel("reference")]


def model_weights(num_layers: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(num_layers) for shape in LAYER_SHAPES] + [HEAD_SHAPE]
    return [torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen) for shape in shapes]


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    """Each call's best time over `rounds` rounds, the calls taking turns within a round."""
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], best_time(fn, reps))
    return best


def token_table(kernels: list[Int8Kernel], weights: list[torch.Tensor], rounds: int, reps: int) -> list[str]:
    packed = {k.name: [k.pack(w) for w in weights] for k in kernels}
    lines = [f"{'rows':>5} {'reference ms':>12}  " + "  ".join(f"{k.name:>22}" for k in kernels[1:])]
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        xs = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen) for k in {w.shape[1] for w in
                                                                                               weights}}
        calls = {k.name: (lambda k=k: [k.matmul(xs[w.shape[1]], p) for w, p in zip(weights, packed[k.name])])
                 for k in kernels}
        best = interleaved(calls, rounds, reps)
        ref = best[kernels[0].name]
        ratios = "  ".join(f"{ref / best[k.name]:>21.2f}x" for k in kernels[1:])
        lines.append(f"{rows:>5} {ref * 1e3:>12.2f}  {ratios}")
    return lines


def shape_table(kernels: list[Int8Kernel], rounds: int, reps: int) -> list[str]:
    lines = [f"{'shape [out, in]':>16} {'reference us':>12}  " + "  ".join(f"{k.name:>22}" for k in kernels[1:])]
    gen = torch.Generator().manual_seed(2)
    for n, k in (*LAYER_SHAPES, HEAD_SHAPE):
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        x = torch.randint(-127, 128, (1, k), dtype=torch.int8, generator=gen)
        packed = {kn.name: kn.pack(weight) for kn in kernels}
        best = interleaved({kn.name: (lambda kn=kn: kn.matmul(x, packed[kn.name])) for kn in kernels}, rounds, reps)
        ref = best[kernels[0].name]
        lines.append(f"{f'{n}x{k}':>16} {ref * 1e6:>12.1f}  " +
                     "  ".join(f"{ref / best[kn.name]:>21.2f}x" for kn in kernels[1:]))
    return lines


CALLS_PER_GRAPH = 8  # weights of one shape a graph multiplies in turn: its Python guards and wrapper paid once


class FrozenLinears(torch.nn.Module):
    """oneDNN's int8 op over CALLS_PER_GRAPH weights of one shape, frozen into the graph as --compile-gemms freezes
    them, each multiplying its own row in turn (as a step's graph calls its layers' matmuls)."""

    def __init__(self, kernel: OneDNNKernel, packed: list[tuple]):
        super().__init__()
        self.kernel = kernel
        self.layers = torch.nn.ParameterList([p for layer in packed for p in layer])

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        packed = [tuple(self.layers[3 * i : 3 * i + 3]) for i in range(rows.shape[0])]
        return torch.cat([self.kernel.matmul(rows[i : i + 1], packed[i]) for i in range(rows.shape[0])])


def template_table(rounds: int, reps: int) -> list[str]:
    """Per shape: the seconds a frozen graph of CALLS_PER_GRAPH weights takes to compile, and its one-row calls
    against oneDNN's, interleaved."""
    kernel = OneDNNKernel()
    lines = [f"{'shape [out, in]':>16} {'compile s':>10} {'oneDNN us':>10} {'template':>9}"]
    gen = torch.Generator().manual_seed(3)
    for n, k in (*LAYER_SHAPES, HEAD_SHAPE):
        packed = [kernel.pack(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))
                  for _ in range(CALLS_PER_GRAPH)]
        rows = torch.randint(-127, 128, (CALLS_PER_GRAPH, k), dtype=torch.int8, generator=gen)
        torch._dynamo.reset()  # each shape a first compile, none refused by Dynamo's recompile limit
        start = time.perf_counter()
        with torch.no_grad(), freezing(True), quiet_autotuning(True):
            compiled = torch.compile(FrozenLinears(kernel, packed), options=dict(GEMM_OPTIONS), dynamic=False)
            sums = compiled(rows)
        compile_s = time.perf_counter() - start
        eager = lambda: [kernel.matmul(rows[i : i + 1], p) for i, p in enumerate(packed)]  # noqa: E731
        if not torch.equal(sums, torch.cat(eager())):
            raise AssertionError(f"the template's sums differ from oneDNN's at {n}x{k}")
        with torch.no_grad():
            best = interleaved({"onednn": eager, "template": lambda: compiled(rows)}, rounds, reps)
        lines.append(f"{f'{n}x{k}':>16} {compile_s:>10.1f} {best['onednn'] / CALLS_PER_GRAPH * 1e6:>10.1f} "
                     f"{best['onednn'] / best['template']:>8.2f}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=NUM_LAYERS, help="layers of weights per token (default 30)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per route per round (default 5)")
    parser.add_argument("--inductor-template", action="store_true",
                        help="also compile oneDNN's op over one frozen weight per shape (--compile-gemms' route)")
    args = parser.parse_args(argv)
    kernels = sorted(routes(), key=lambda k: not isinstance(k, OneDNNKernel))  # oneDNN's qlinear: the reference
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; reference: {kernels[0].name}; "
          "each route as the reference's time / its own (higher is faster)")
    print(f"\none decode token's int8 matmuls ({args.layers} layers + head), by rows per call:")
    print("\n".join(token_table(kernels, model_weights(args.layers), args.rounds, args.reps)))
    print("\none call at one row, by weight shape:")
    print("\n".join(shape_table(kernels, args.rounds, args.reps)))
    if args.inductor_template and isinstance(kernels[0], OneDNNKernel):
        print(f"\nInductor's C++ GEMM template over {CALLS_PER_GRAPH} frozen weights per shape, one row each, in one "
              "graph (÷ oneDNN's calls):")
        print("\n".join(template_table(args.rounds, args.reps)))


if __name__ == "__main__":
    main()
