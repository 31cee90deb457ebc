"""Room on CPython's frame stack for a step, so that its repeated calls never cross into a new chunk.

CPython (3.11 on) keeps a thread's Python frames in chunks of 16 KiB, mapped with mmap. A call that does not fit
in the current chunk maps a new one, and returning from it unmaps that chunk at once. A loop that calls a function
at exactly that depth maps and unmaps a chunk at every call: a page fault and, with another thread running (a
torch worker), a TLB shootdown that interrupts it (CPython's issue gh-142183; 3.13 and 3.14 cache one chunk since
2026, 3.11 and 3.12 do not). Where that depth falls depends on the caller's
stack: the whole compiled graph in layer regions (30 calls of one layer's code a step) was slower than eager when
served and faster when `kvserve bench step` replayed it, until steps ran under this (docs/benchmarks.md, "Why:
CPython's frame-stack chunks").

`with_stack_headroom(fn, ...)` calls fn from a frame larger than any chunk's free space, so that frame starts a
chunk of its own, four times as large, and fn's calls run with the rest of it free: the same room at every step,
whoever calls. It costs one mapping a step, microseconds."""
from __future__ import annotations

# The caller's frame: 4,096 local slots (32 KiB) do not fit in the free part of a 16 KiB chunk, so it always
# starts a new chunk; CPython sizes that chunk to the frame plus 1,000 slots, rounded up to a power of two
# (64 KiB), which leaves fn's calls the other 31 KiB.
HEADROOM_SLOTS = 4096


def _caller(slots: int):
    """A function whose frame has `slots` local slots (never assigned: CPython reserves and clears them)."""
    names = ", ".join(f"_{i}" for i in range(slots))
    source = (f"def with_stack_headroom(fn, *args, **kwargs):\n"
              f"    \"\"\"fn(*args, **kwargs), with 31 KiB of CPython's frame stack free for its calls.\"\"\"\n"
              f"    if False:\n        {names} = None\n"
              f"    return fn(*args, **kwargs)\n")
    namespace: dict = {}
    exec(compile(source, __name__, "exec"), namespace)  # generated from a count alone: no outside input
    return namespace["with_stack_headroom"]


with_stack_headroom = _caller(HEADROOM_SLOTS)
