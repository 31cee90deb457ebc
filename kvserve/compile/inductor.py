"""What the compiled steps ask of Dynamo and Inductor: which guards a step checks, torch.compile's own timers, the
freezing flag and quiet autotuning for --compile-gemms, and the process's resident memory for the start-up line."""
from __future__ import annotations

import contextlib
import os
import warnings
from unittest import mock

import torch

from kvserve.saved_graphs import saveable_guards

# where the graphs reach what never changes in an engine's life: its model (the forward copy's global) and the layers
# that the regions hold (CompiledSteps._regions, built once)
ENGINE_CONSTANTS = ("G['_engine']", "meta.layer_regions")


def step_guards(entries) -> list[bool]:
    """Which of Dynamo's guards a compiled step checks (torch.compile's guard_filter_fn): those on the step (the
    inputs' sizes and kinds, the metadata, the cache), not those on the model's weights and layers, which the engine
    never changes and whose graphs are its own (CompiledSteps). Those were most of the guards, checked at every
    step: each weight's tensor check and sizes, that no two weights alias, that shared scales stay shared. Nor
    those on globals (kvserve's code, which names a saved graph: kvserve/saved_graphs.py) or of kinds torch cannot
    save with a graph (an object's identity)."""
    return [saveable and not entry.name.startswith(ENGINE_CONSTANTS)
            for saveable, entry in zip(saveable_guards(entries), entries)]


# torch.compile's own timers (torch._dynamo.utils.compilation_time_metrics) named in the start-up line
COMPILE_PHASES = {"bytecode_tracing": "Dynamo's tracing", "create_aot_dispatcher_function": "Inductor",
                  "build_guards": "guards"}


def phase_seconds() -> dict[str, float]:
    """Seconds torch.compile has spent so far in this process in each of COMPILE_PHASES (its own timers, a module
    dict of torch._dynamo.utils; none where a torch version keeps no such dict)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return {name: float(sum(metrics.get(name, ()))) for name in COMPILE_PHASES}


def freezing(on: bool):
    """--compile-gemms: Inductor's freezing flag set while Dynamo traces (Dynamo reads the global flag, not the
    compile's options, to lift nn.Parameters as the graph's parameters) and while it checks the graphs' guards."""
    return torch._inductor.config.patch(freezing=True) if on else contextlib.nullcontext()


@contextlib.contextmanager
def quiet_autotuning(on: bool):
    """Inductor prints each GEMM's autotuning table to stderr, hundreds of lines, under a module flag of its own, and
    its lowering of oneDNN's int8 linear warns twice about its own code (a tensor copy, a deprecated storage call)."""
    if not on:
        yield
        return
    from torch._inductor import select_algorithm  # Inductor's, imported only when it compiles
    with mock.patch.object(select_algorithm, "PRINT_AUTOTUNE", False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning)
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        yield


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
