"""Reads compiled into one loop by `torch.compile` (PyTorch's CPU inductor: C++ generated, and built with the
machine's C++ compiler, on first use), with the eager read as the fallback.

A quantized read in plain PyTorch ops is several passes over the whole context: select the codes, split the
nibbles, widen to float, scale, shift, copy into the attention buffer. Compiled, it is one loop that reads the
codes once and writes each float once. Nothing is built at install time: the first read in a process compiles
(seconds; the engine does it at start-up, see `warm_up`), later processes reuse inductor's on-disk cache.
A format's `warm_up` compiles at engine start with its batch dimensions marked dynamic and sizes of 1 not
specialised, so one graph serves every batch shape; the rest (block size, heads, head size) stay constants the
loop is specialised for. If compiling fails (no C++ compiler, an unsupported platform), the format logs why once and reads
eagerly; `enforce_eager` (EngineConfig, `--enforce-eager`) skips compiling altogether."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx.experimental._config as fx_config

logger = logging.getLogger("kvserve")


class CompiledFunction:
    """`fn` compiled on first call; `None` from a call means "not available: read eagerly"."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.compiled = torch.compile(fn)
        self.failed: str | None = None

    def warm_up(self, args: tuple, dynamic: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
        """Compile for `args` with the given (tensor, dim) sizes dynamic, and sizes of 1 not specialised, so one
        graph serves every batch shape (a decode step's single query included). The graph matches later calls
        only if `args` are made as theirs are (in or outside inference mode: guards compare dispatch keys)."""
        for tensor, dim in dynamic:
            torch._dynamo.mark_dynamic(tensor, dim)
        # Each model shape (heads, head size, block size, dtype) adds graphs to the same function: more than
        # dynamo's default limit of 8 when one process (a test run) builds many models.
        with fx_config.patch(backed_size_oblivious=True), torch._dynamo.config.patch(recompile_limit=64):
            return self(*args)

    def __call__(self, *args) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compile failure means: fall back, and say why once
            first_line = (str(exc).strip().splitlines() or [""])[0]
            self.failed = f"{type(exc).__name__}: {first_line}"
            logger.warning(f"KV cache: compiling {self.fn.__name__} failed ({self.failed}); reading eagerly (slower)")
            return None
