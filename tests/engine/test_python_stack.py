"""with_stack_headroom: a loop of calls maps no frame-stack chunk per call, at whatever depth it is called, and every
engine step runs under it. Counted in minor page faults (a new chunk's first touch), not timed."""
import resource
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.python_stack import with_stack_headroom
from tests.conftest import make_tiny_model, save_char_tokenizer

CALLS = 400
DEPTHS = range(0, 400)  # frames of ~100 bytes: 40 KB of depths, over two chunk boundaries

_namespace: dict = {}
exec("def leaf():\n    " + " = ".join(f"v{i}" for i in range(48)) + " = 0\n", _namespace)  # a 400-byte frame
leaf = _namespace["leaf"]


def loop(calls: int) -> None:
    for _ in range(calls):
        leaf()


def at_depth(depth: int, work, *args) -> None:
    if depth:
        return at_depth(depth - 1, work, *args)
    return work(*args)


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worst_faults(work) -> int:
    """The most page faults one loop of CALLS calls took, over every depth it was started at."""
    worst = 0
    for depth in DEPTHS:
        before = faults()
        at_depth(depth, work, CALLS)
        worst = max(worst, faults() - before)
    return worst


def test_a_loop_at_a_chunk_boundary_maps_a_chunk_per_call_without_it():
    """The sweep finds the boundary: on this CPython a plain loop at some depth faults at every call (if it does
    not, this CPython caches a chunk, gh-142183, and the headroom only costs its one mapping)."""
    worst = worst_faults(loop)
    print(f"a plain loop of {CALLS} calls: {worst} page faults at the worst depth")
    if worst < CALLS:
        pytest.skip(f"CPython {sys.version.split()[0]} keeps a spare frame-stack chunk: {worst} faults at worst")
    assert worst >= CALLS


def test_a_loop_under_the_headroom_maps_no_chunk_per_call_at_any_depth():
    """Its own chunk, 64 KiB, is up to 16 faults a call of it; a loop crossing a boundary is one a call."""
    worst = worst_faults(lambda calls: with_stack_headroom(loop, calls))
    print(f"under with_stack_headroom: {worst} page faults at the worst depth")
    assert worst < CALLS // 4, f"{worst} page faults for {CALLS} calls: the loop crossed a chunk boundary"


def test_with_stack_headroom_passes_arguments_and_the_result_through():
    assert with_stack_headroom(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(KeyError):
        with_stack_headroom({}.__getitem__, "missing")


def test_every_engine_step_runs_under_the_headroom(tmp_path):
    llm = LLM(str(save_char_tokenizer(make_tiny_model(tmp_path, "llama-gqa"))), kv_cache_memory="1MiB",
              max_model_len=64)
    runner = llm.engine.runner
    run, callers = runner.run, []

    def recording(out):
        frame, names = sys._getframe(), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        callers.append("with_stack_headroom" in names)
        return run(out)

    runner.run = recording
    llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(callers) == 4 and all(callers)
