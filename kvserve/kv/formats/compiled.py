"""Decode attention compiled by `torch.compile` (PyTorch's CPU inductor: C++ generated, and built with the
machine's C++ compiler), with the eager path as the fallback.

A quantized format read with plain PyTorch ops is several passes over the whole context (select the codes,
widen, scale, copy into the attention buffer) before attention reads it again. Written as plain tensor ops — the
dequantization, then attention as broadcast products and sums (`attend`) — and compiled, it becomes a few
generated loops. int8, int4 and nuq4/nuq3 (formats.nonuniform) do this; fp8 measured slower compiled
(formats.fp8). Nothing is built at install time: the engine compiles at start-up (`warm_up_decode`: seconds) and
saves each graph whole (kvserve/saved_graphs.py, as the step graphs are), named by the kernel's closure (block size,
bits) and the machine; a later start loads them and runs no Dynamo. The warm-up marks the batch dimensions dynamic
and does not specialise sizes of 1, so one graph serves every batch shape (a single request gets a second one);
block size, heads and head size stay constants the loops are specialised for. Nothing compiles after the warm-up:
a call no graph takes is attended eagerly. If compiling fails (no C++ compiler, an unsupported platform), the
format logs why once and attends eagerly; `enforce_eager` (EngineConfig, `--enforce-eager`) skips compiling
altogether."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterator

import torch
import torch.fx.experimental._config as fx_config

from kvserve.inductor_isa import remember_vec_isa_probe
from kvserve.saved_graphs import GraphKey, GraphMiss, GraphSet, first_line

logger = logging.getLogger("kvserve")

KERNEL_DIRECTORY = "decode-kernels"  # the saved kernels' place in the graph directory, apart from the step graphs


class CompiledFunction:
    """`fn` compiled (or loaded) at warm-up for the inputs it is called with there; `None` from a call means "not
    available: use the eager path"."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        self.fn = fn
        self.graphs: GraphSet | None = None  # named at the first warm-up, once Inductor's ISA is settled
        self.failed: str | None = None
        self.warming = False
        self._misses: set[str] = set()  # why calls fitted no graph, each said once

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Calls made inside compile (or load) a graph where none takes them, with their `dynamic` dimensions
        marked (see __call__)."""
        remember_vec_isa_probe()  # first: it may set Inductor's vec_isa_ok, which the graphs' name holds
        if self.graphs is None:
            key = GraphKey.of(self.fn, {"backed_size_oblivious": True}, subdirectory=KERNEL_DIRECTORY)
            self.graphs = GraphSet(self.fn, {}, key, {}, shared=True)
        self.warming = True
        try:
            yield
        finally:
            self.warming = False

    def __call__(self, args: tuple, dynamic: list[tuple[torch.Tensor, int]] = ()) -> torch.Tensor | None:
        """fn(*args), compiled. While warming up, a graph is compiled (or loaded) where none takes the call, the
        (tensor, dim) sizes in `dynamic` made dynamic and sizes of 1 not specialised, so the graph serves every batch
        shape. A graph matches a later call only if its arguments are made alike (in or outside inference mode:
        guards compare dispatch keys)."""
        if self.failed is not None:
            return None
        try:
            if not self.warming:
                if self.graphs is None:
                    raise GraphMiss("not warmed up")
                return self.graphs(*args)
            name = f"{self.fn.__name__}-{args[0].shape[0]}-{argument_kinds(args, dynamic)}"
            with fx_config.patch(backed_size_oblivious=True):
                return self.graphs.run_or_compile(name, args, lambda: mark_dynamic(dynamic))
        except GraphMiss as miss:  # nothing compiles while serving: this call is attended eagerly
            if str(miss) not in self._misses:
                self._misses.add(str(miss))
                logger.warning(f"a call fits no compiled {self.fn.__name__} ({miss}); running it eagerly, "
                               "no compiling while serving")
            return None
        except Exception as exc:  # noqa: BLE001 - any compile failure means: fall back, and say why once
            self.failed = first_line(exc)
            logger.warning(f"compiling {self.fn.__name__} failed ({self.failed}); running it eagerly (slower)")
            return None

    def __getstate__(self) -> dict:
        """Its function and state, not its graphs: a step graph whose guards read the cache keeps a copy of what they
        read, pickled with it (torch's AOT precompile), and the kernel's graphs are saved on their own."""
        return {**self.__dict__, "graphs": None}

    @property
    def graphs_loaded(self) -> int:
        return 0 if self.graphs is None else self.graphs.loaded

    @property
    def graphs_compiled(self) -> int:
        return 0 if self.graphs is None else self.graphs.compiled


def argument_kinds(args: tuple, dynamic: list[tuple[torch.Tensor, int]]) -> str:
    """What a graph's guards check of its arguments besides the batch's sizes, as a digest for its file's name: each
    tensor's dtype, device, whether it is an inference tensor (its dispatch keys) and the sizes that are constants
    (every size but the `dynamic` ones). A cache of another dtype or head size names graphs of its own; one of
    another pool size or batch finds the same."""
    marked = {(id(tensor), dim) for tensor, dim in dynamic}
    kinds = [[str(a.dtype), str(a.device), [None if (id(a), d) in marked else n for d, n in enumerate(a.shape)]]
             + (["inference"] if a.is_inference() else []) if isinstance(a, torch.Tensor) else repr(a) for a in args]
    return hashlib.sha256(json.dumps(kinds).encode()).hexdigest()[:12]


def mark_dynamic(dynamic: list[tuple[torch.Tensor, int]]) -> None:
    for tensor, dim in dynamic:
        torch._dynamo.mark_dynamic(tensor, dim)


def decode_kind(compiled: CompiledFunction | None) -> str:
    """How a format's decode attention runs, for its start-up line."""
    return "eager" if compiled is None or compiled.failed else "compiled"


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per request, in float32: q [S, kv_heads, heads per kv head, head_dim], already multiplied by the
    softmax scale; keys and values [S, K, kv_heads, head_dim]; mask [S, 1, 1, K]. Returns [S, kv_heads, heads per
    kv head, head_dim] in q's dtype. Scores and weighted sum are broadcast products and sums, not matmuls, so
    inductor fuses them with the dequantization that produced the keys and values."""
    S, K = keys.shape[:2]
    scores = (q[:, None].float() * keys[:, :, :, None, :]).sum(-1)  # [S, K, kv_heads, heads per kv head]
    scores = scores.masked_fill(~mask.view(S, K, 1, 1), float("-inf"))
    probs = scores.softmax(dim=1)
    return (probs[..., None] * values[:, :, :, None, :]).sum(dim=1).to(q.dtype)


def warm_up_decode(cache, compiled: CompiledFunction, num_query_heads: int, extra_keys: int,
                   batches: tuple[int, ...] = (8, 1)) -> None:
    """Compile `cache.decode_attention` (which calls `compiled`) on typical decode batches of `batches` requests,
    made as the runner (outside inference mode) and the model (inside) make them, so the engine's calls match the
    graphs; inductor picks its loop order and threading from these sizes. `extra_keys`: keys per request beyond its
    blocks'. One request alone gets a graph of its own (S * B == B)."""
    H, D, G = cache.num_kv_heads, cache.head_dim, num_query_heads // cache.num_kv_heads
    for S, B in ((S, 32) for S in batches):
        tables = torch.arange(S * B, device=cache.device).view(S, B) % cache.num_blocks
        own_blocks = torch.full((S,), -1, device=cache.device)
        mask = torch.ones(S, 1, 1, B * cache.block_size + extra_keys, dtype=torch.bool, device=cache.device)
        with torch.inference_mode(), compiled.warming_up():
            queries = torch.zeros(S, 1, H, G, D, dtype=cache.dtype, device=cache.device).view(S, H, G, D)
            new_k, new_v = (torch.zeros(S, 1, H, D, dtype=cache.dtype, device=cache.device) for _ in range(2))
            cache.decode_attention(0, queries, tables, own_blocks, new_k, new_v, mask, 1.0)
