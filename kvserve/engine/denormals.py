"""Denormal floats flushed to zero on every thread that computes an engine's steps.

A Gated DeltaNet layer decays its recurrent state by exp(g) every token, and its chunked prompt rule multiplies by
exp of cumulative decays: strongly decaying heads make numbers below float32's smallest normal (1.2e-38). x86 CPUs
compute on such denormal numbers through microcode assists, many times slower than on normal ones: the chunked rule
over fresh prompts with a random-weight model's decays ran 3x slower with them kept on the Intel Xeon
(`python -m kvserve.bench.delta_rule`, docs/benchmarks.md).
Flushing them to zero (the CPU's FTZ and DAZ modes, `torch.set_flush_denormal`) changes no result above 1.2e-38.

The mode belongs to each thread, and PyTorch sets it on the calling thread only; the matmuls, the compiled kernels
and the BLAS run on the OpenMP threads of the thread that calls them, which a new thread inherits the mode from but
an existing one does not. So `flush_denormals()` sets it on the calling thread and then on each thread of that
thread's OpenMP team, by running one parallel region of the OpenMP runtime PyTorch loaded (its GNU entry point, which
Intel's runtime provides too) whose body sets it. Once per calling thread; where it cannot (not x86, no such runtime,
a team of fewer threads than PyTorch uses), the start-up line says so and nothing else changes."""
from __future__ import annotations

import ctypes
import re
import threading

import torch

BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a parallel region's body: void fn(void *data)
_done: dict[int, str] = {}  # calling thread's id -> what was done there
_lock = threading.Lock()


def flush_denormals() -> str:
    """Flush denormals on this thread and its OpenMP team (once per thread); returns what was done, for the
    start-up line."""
    ident = threading.get_ident()
    with _lock:
        if ident not in _done:
            _done[ident] = _flush_here_and_in_team()
        return _done[ident]


def _flush_here_and_in_team() -> str:
    if not torch.set_flush_denormal(True):
        return "denormal floats computed as they are (this CPU has no flush-to-zero mode PyTorch sets)"
    threads = torch.get_num_threads()
    if threads == 1:
        return "denormal floats flushed to zero (one compute thread)"
    parallel = _omp_parallel()
    if parallel is None:
        return "denormal floats flushed to zero on the calling thread only (no OpenMP runtime found to reach the rest)"
    flushed: set[int] = set()

    @BODY
    def body(_data):  # runs on every thread of the team, each taking the GIL in turn
        if torch.set_flush_denormal(True):
            flushed.add(threading.get_native_id())

    parallel(body, None, threads, 0)
    if len(flushed) < threads:
        return f"denormal floats flushed to zero on {len(flushed)} of {threads} compute threads"
    return f"denormal floats flushed to zero on all {threads} compute threads"


def _omp_parallel():
    """GOMP_parallel(fn, data, num_threads, flags) of the OpenMP runtime this process loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if re.search(r"/lib(gomp|iomp5)[^/]*\.so", line)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            function = ctypes.CDLL(path).GOMP_parallel
        except (OSError, AttributeError):
            continue
        function.argtypes = [BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        function.restype = None
        return function
    return None
