"""Keep the C heap's freed memory for the next step instead of giving it back to the OS (glibc on Linux).

On a CPU every step allocates large temporaries again (the K/V gathered for attention, the activations of up
to max_num_batched_tokens tokens) and frees them at its end. By default glibc serves a block above a moving
threshold with a fresh mmap and hands back freed memory at the top of its heap, so a step can page-fault its
temporaries in anew, one zeroed 4 KiB page at a time: 1.5 million minor faults in one int8 decode-heavy
bench run, where int8 ran 1.07-1.26x faster with the heap kept (docs/benchmarks.md). Two mallopt settings stop it:
blocks up to 32 MiB (as high as glibc's own moving threshold goes) come from the heap, and up to 1 GiB freed at
its top is kept for reuse. The heap then stays
at its peak size, which is the step's own working set. A process whose environment sets glibc's malloc
(GLIBC_TUNABLES or a MALLOC_* variable) is left as it asked."""
from __future__ import annotations

import ctypes
import functools
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 2**30


@functools.cache
def keep_freed_heap() -> str:
    """Apply the settings once per process; returns what was done, for the start-up log."""
    if platform.libc_ver()[0] != "glibc":
        return "C heap: not glibc, left as it is"
    configured = sorted(k for k in os.environ if k == "GLIBC_TUNABLES" or k.startswith("MALLOC_"))
    if configured:
        return f"C heap: left as the environment sets it ({', '.join(configured)})"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                   TRIM_THRESHOLD_BYTES)):
        return "C heap: glibc refused mallopt, left as it is"
    return ("C heap: freed memory kept for the next step (glibc mallopt: blocks up to 32 MiB from the heap, "
            "up to 1 GiB kept at its top)")
