"""Denormal floats flushed to zero while an engine's steps run, on the thread that runs them and its OpenMP team.

A Gated DeltaNet layer decays its recurrent state by exp(g) every token, and its chunked prompt rule multiplies by
exp of cumulative decays: strongly decaying heads make numbers below float32's smallest normal (1.2e-38). x86 CPUs
compute on such denormal numbers through microcode assists, many times slower than on normal ones: the chunked rule
over fresh prompts with a random-weight model's decays ran 3.26x slower with them kept on the Intel Xeon
(`python -m kvserve.bench.delta_rule`, docs/benchmarks.md). Flushing them to zero (the CPU's FTZ and DAZ modes,
`torch.set_flush_denormal`) changes no result above 1.2e-38.

The mode belongs to each thread's floating-point environment, and PyTorch sets it on the calling thread only; the
matmuls, the compiled kernels and the BLAS run on the OpenMP team of the thread that calls them, whose threads keep
the environment they were created with. So `flushed_denormals()` sets the mode on the calling thread, copies that
thread's environment to every thread of its team by one parallel region of the OpenMP runtime PyTorch loaded (its
GNU entry point, which Intel's runtime provides too, with libm's `fesetenv` as the region's body), and when the
block ends puts the environment the calling thread had before back on all of them: outside the engine's steps the
process computes as it did (Python's floats, NumPy, the user's own tensors). Where there is no such runtime or libm
(not Linux with glibc), only the calling thread is flushed; where the CPU has no such mode, nothing changes; the
start-up line says which (`describe()`)."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import re
import threading

import torch

ENV_BYTES = 64  # glibc's fenv_t is 32 bytes on x86-64 (the x87 state and MXCSR): room to spare
BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a parallel region's body: void fn(void *data)
TINY = 5e-324  # the smallest denormal double: times 1.0 it stays itself, or is 0 where denormals are flushed


@contextlib.contextmanager
def flushed_denormals():
    """Denormals flushed to zero on this thread and its OpenMP team while the block runs; their floating-point
    environment as this thread had it afterwards."""
    runtime = _runtime()
    if runtime is None:  # no libm to save the environment with: the mode alone, on this thread
        on = torch.set_flush_denormal(True)
        try:
            yield
        finally:
            if on:
                torch.set_flush_denormal(False)
        return
    fegetenv, fesetenv, parallel, body = runtime
    threads = torch.get_num_threads()

    def set_everywhere(env) -> None:  # this thread's environment, and its team's where the runtime is found
        if parallel is None:
            fesetenv(env)
        else:
            parallel(body, env, threads, 0)

    saved, flushed = ctypes.create_string_buffer(ENV_BYTES), ctypes.create_string_buffer(ENV_BYTES)
    fegetenv(saved)
    if not torch.set_flush_denormal(True):
        yield
        return
    fegetenv(flushed)
    set_everywhere(flushed)
    try:
        yield
    finally:
        set_everywhere(saved)


def describe() -> str:
    """What flushed_denormals() does on this thread and CPU, for the start-up line: each thread of the team is
    asked, inside the block, whether it flushes."""
    threads = torch.get_num_threads()
    runtime = _runtime()
    parallel = runtime[2] if runtime is not None else None
    flushing: set[int] = set()

    @BODY
    def ask(_data):  # runs on every thread of the team, each taking the GIL in turn
        if _flushes():
            flushing.add(threading.get_native_id())

    with flushed_denormals():
        if not _flushes():
            return "denormal floats computed as they are (this CPU has no flush-to-zero mode PyTorch sets)"
        if threads == 1 or parallel is None:
            reach = "one compute thread" if threads == 1 else "the calling thread only (no OpenMP runtime found)"
            return f"denormal floats flushed to zero while steps run, on {reach}"
        parallel(ctypes.cast(ask, ctypes.c_void_p), None, threads, 0)
    return f"denormal floats flushed to zero while steps run, on {len(flushing)} of {threads} compute threads"


def _flushes() -> bool:
    """Whether this thread flushes denormals now (Python's floats are computed in the same unit)."""
    tiny = TINY
    return tiny * 1.0 == 0.0


@functools.cache
def _runtime():
    """(fegetenv, fesetenv, GOMP_parallel or None, fesetenv's address as a parallel region's body) from libm and
    the OpenMP runtime this process loaded; None without libm. fesetenv, int fn(const fenv_t *), is called as the
    region's void fn(void *)."""
    name = ctypes.util.find_library("m")
    try:
        libm = ctypes.CDLL(name) if name else None
        functions = (libm.fegetenv, libm.fesetenv) if libm is not None else None
    except (OSError, AttributeError):
        return None
    if functions is None:
        return None
    for function in functions:
        function.argtypes = [ctypes.c_void_p]
    parallel = _omp_parallel()
    if parallel is not None:
        parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        parallel.restype = None
    return (*functions, parallel, ctypes.cast(functions[1], ctypes.c_void_p).value)


def _omp_parallel():
    """GOMP_parallel(fn, data, num_threads, flags) of the OpenMP runtime this process loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if re.search(r"/lib(gomp|iomp5)[^/]*\.so", line)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).GOMP_parallel
        except (OSError, AttributeError):
            continue
    return None
