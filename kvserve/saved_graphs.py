"""Compiled graphs kept on disk whole, so that a later start loads them instead of tracing the code again: the
engine's step graphs (compile/steps.py) and the KV formats' decode kernels (kv/formats/compiled.py). torch.compile's
own caches keep what Inductor generates but not Dynamo's work, which every start repeated, while torch's AOT
precompile saves a graph with Dynamo's bytecode and guards, and a loaded graph runs no Dynamo at all. A saved graph
is named by everything its code depends on and its guards do not check (GraphKey: kvserve's source, torch, Python,
the machine, Inductor's settings, the graph's options, the structure of the objects it reads: the model and cache,
or a kernel's closure). The files are pickles, read only from Inductor's cache directory, owned by this user and
writable by no one else; one that cannot be read is compiled again and written over. docs/architecture.md
("Compiled steps") says more, docs/benchmarks.md (`kvserve bench startup`) what it saves."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from kvserve.private_files import not_private, private_directory

logger = logging.getLogger("kvserve")

DIRECTORY_NAME = "kvserve-graphs"
# Graphs that refer to nothing of an engine (a KV format's kernel: GraphSet's `shared`), by file name: a later set of
# the same name in this process takes them as they are, as Dynamo's own cache kept a function's graphs for the
# process (engines built one after another: a test run, `kvserve bench throughput`).
PROCESS_GRAPHS: dict[str, Any] = {}


class GraphMiss(Exception):
    """No graph of a GraphSet takes these inputs (each graph's first failed guard)."""


class GraphSet:
    """One function's compiled graphs: each compiled for its example inputs at start, or loaded from disk where an
    earlier start saved it. A call runs the graph whose guards take its inputs (the last one run is tried first).

    With `save=False` (frozen weights, --compile-gemms: constants that torch cannot save with a graph, nor can its
    AOT precompile return such a graph), or with Inductor's caches turned off, the function is torch.compile's as
    it is, traced at every start, and a call that would compile a graph while serving is refused by Dynamo's
    fail_on_recompile stance instead. `shared`: the function refers to nothing of an engine (`external` is empty),
    so its graphs are kept for the process too (PROCESS_GRAPHS)."""

    def __init__(self, function: Callable, options: dict, key: GraphKey, external: dict[str, Any],
                 save: bool = True, shared: bool = False):
        self.function = function  # an engine's own copy: its globals reach that engine's model
        self.key = key
        self.external = external  # the engine's objects a graph refers to by name (its layers), not saved with it
        # Inductor's caches turned off (TORCHINDUCTOR_FORCE_DISABLE_CACHES, for debugging): torch's AOT precompile
        # refuses to run, so the function is traced at every start as with frozen weights
        self.save = save and not torch._inductor.config.force_disable_caches
        # the graphs' own choice of guards (a saved graph: torch's where they name none; a traced one: every guard),
        # less the pytree registry's
        chosen = options.get("guard_filter_fn") or (saveable_guards if self.save else None)
        self.options = {**options, "guard_filter_fn": without_registry_guard(chosen)}
        self.shared = shared and not external
        self.graphs: list = []  # AOT-compiled functions (save), or the one torch.compile'd function (not save)
        self._checks: dict[int, Callable[[tuple], bool]] = {}  # each saved graph's guards (guard_check), by its id
        self.loaded = 0  # graphs read from disk (or, shared, taken from this process's)
        self.compiled = 0  # graphs compiled by this process

    def add(self, name: str, args: tuple, mark: Callable[[], None] = lambda: None) -> None:
        """A graph for `args` (tensors whose sizes are symbols marked by `mark`, called only when it is compiled):
        loaded where a file for it exists, compiled and saved where not."""
        if not self.save:
            mark()
            if not self.graphs:  # a copy of the options: torch.compile takes guard_filter_fn out of its dict
                self.graphs.append(torch.compile(self.function, dynamic=False, options=dict(self.options)))
            self.graphs[0](*args)  # traced and compiled for these inputs
            self.compiled += 1
            return
        path = self.key.path(name)
        graph = PROCESS_GRAPHS.get(path.name) if self.shared else None
        graph = graph or self._load(path)
        if graph is not None:
            self.loaded += 1
        else:
            mark()
            compiled = torch.compile(self.function, fullgraph=True, dynamic=False, options=dict(self.options))
            graph = compiled.aot_compile((args, {}))
            self.compiled += 1
            self._save(graph, path)
        self.graphs.append(graph)
        self._checks[id(graph)] = guard_check(graph)
        if self.shared:
            PROCESS_GRAPHS[path.name] = graph

    def _load(self, path: Path) -> Any:
        """The graph saved at `path`, or None: no file, or one not to trust or that cannot be read (said)."""
        if not path.exists():
            return None
        if (untrusted := not_private(path)) is not None:
            logger.warning(f"compiled graph {path} not loaded: {untrusted}; compiling it again")
            return None
        from torch._guards import TracingContext, tracing

        try:  # in a context of its own: a guard's source that names an import (flex_attention's) installs a guard
            with open(path, "rb") as file, tracing(TracingContext(None)):  # there as it is unpickled (torch 2.13)
                return torch.compiler.load_compiled_function(file, f_globals=self.function.__globals__,
                                                             external_data=self.external)
        except Exception as exc:  # another torch's file, a truncated one: compiled again, written over
            logger.warning(f"compiled graph {path} could not be loaded ({first_line(exc)}); compiling it again")
            return None

    def _save(self, graph: Any, path: Path) -> None:
        try:
            private_directory(path.parent)
            graph.save_compiled_function(str(path), external_data=self.external)  # a private file (mode 0600)
        except Exception as exc:  # a full disk, a read-only cache: this start runs it, the next compiles again
            logger.warning(f"compiled graph not saved to {path} ({first_line(exc)}); the next start compiles it "
                           "again")

    def takes(self, args: tuple) -> bool:
        """Whether a saved (or saveable) graph of this set takes these inputs."""
        return any(self._checks[id(graph)](args) for graph in self.graphs)

    def run_or_compile(self, name: str, args: tuple, mark: Callable[[], None]) -> Any:
        """Run these inputs, compiling (or loading) a graph for them first if none takes them: a start's warm-up,
        and `kvserve bench step` (never serving)."""
        if not self.save:
            if not self.graphs:
                self.add(name, args, mark)
            mark()
            return self.graphs[0](*args)  # Dynamo compiles a graph if none fits
        if not self.takes(args):
            self.add(name, args, mark)
        return self(*args)

    def __call__(self, *args: Any, mark: Callable[[], None] = lambda: None) -> Any:
        """Run the graph that takes `args` (GraphMiss: none does). A traced function's symbols are marked at each
        call, as when it compiled (`mark`); a saved graph's guards take the inputs unmarked."""
        if not self.save:
            mark()
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self.graphs[0](*args)
            except Exception as exc:
                if RECOMPILE in str(exc):
                    raise GraphMiss(_recompile_reasons(str(exc))) from None
                raise
        for i, graph in enumerate(self.graphs):
            if self._checks[id(graph)](args):
                if i:  # the next call is likely alike (a single stream's decodes, a batch's layers)
                    self.graphs.insert(0, self.graphs.pop(i))
                return graph.fn(*args)
        raise GraphMiss(self.why_not(args))

    def why_not(self, args: tuple) -> str:
        """Each graph's first failed guard."""
        reasons = []
        for i, graph in enumerate(self.graphs):
            try:  # the guards' own account (torch 2.13 keeps it on the function's artifacts)
                failed = graph._artifacts.guard_manager.check_verbose(graph.prepare_f_locals(*args))
                parts = getattr(failed, "verbose_code_parts", None) or ["its guards"]
            except Exception:
                parts = ["its guards"]
            reasons.append(f"graph {i}: {str(parts[0]).strip()}")
        return "; ".join(reasons)[:300] or "no graph"


def guard_check(graph: Any) -> Callable[[tuple], bool]:
    """`graph.guard_check` without binding each call's arguments to the function's signature, which took more of a
    decode kernel's call than the guards themselves: the parameters (all positional) zipped with the arguments, the
    closure's values read once. A function of any other signature is checked as torch checks it."""
    artifacts = graph._artifacts  # torch 2.13's AOT-compiled function
    params, env, manager = list(artifacts.signature.parameters.values()), artifacts.runtime_env, artifacts.guard_manager
    if manager is None or any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params):
        return lambda args: graph.guard_check(*args)
    names = [p.name for p in params]
    closure = dict(zip(env.bytecode.co_freevars, (cell.cell_contents for cell in env.closure))) if env.closure else {}
    return lambda args: len(args) == len(names) and manager.check({**closure, **dict(zip(names, args))})


# Dynamo guards how many classes torch's pytree knows when a traced function flattens one (flex attention's block
# mask does): an import that registers more (transformers' model outputs) would turn every such graph away, the
# saved ones and this process's alike. kvserve's graphs take tensors and numbers, which no class registered later
# flattens differently, so that guard is dropped.
PYTREE_REGISTRY = "utils._pytree.SUPPORTED_NODES"


def saveable_guards(entries) -> list[bool]:
    """Which of Dynamo's guards a saved graph checks where its function names no choice (torch's AOT precompile's
    own): none on a global (kvserve's code, which names the graph: GraphKey) nor of a kind torch cannot save."""
    from torch._dynamo.guards import CheckFunctionManager  # Dynamo's, imported only when it compiles

    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (entry.is_global or entry.guard_type in unsaved) for entry in entries]


def without_registry_guard(guard_filter: Callable | None) -> Callable:
    """torch.compile's guard_filter_fn: `guard_filter`'s choice (every guard where None) less the pytree registry's
    guard."""
    def guards(entries) -> list[bool]:
        kept = guard_filter(entries) if guard_filter is not None else [True] * len(entries)
        return [keep and PYTREE_REGISTRY not in entry.name for keep, entry in zip(kept, entries)]
    return guards


RECOMPILE = "Detected recompile"  # how Dynamo's fail_on_recompile stance refuses a call no traced graph fits


def _recompile_reasons(message: str) -> str:
    """Why each traced graph refused a call, from Dynamo's refusal ("- 0/0: 2 <= ...size()[1]  # source line"):
    each graph's first failed condition, oldest graph first."""
    found = re.findall(r"^\s*- (\d+/\d+): (.*?)(?:\s+#|$)", message, re.MULTILINE)
    return "; ".join(f"graph {graph}: {condition}" for graph, condition in sorted(found))[:300] or \
        first_line(message)


def first_line(exc: Exception | str) -> str:
    """An exception (its type and first line) or a message's first line, at most 300 characters: for a log line."""
    text = exc if isinstance(exc, str) else str(exc)
    head = text.splitlines()[0] if text else ""
    return (head if isinstance(exc, str) else f"{type(exc).__name__}: {head}")[:300]


@dataclasses.dataclass(frozen=True)
class GraphKey:
    """What a saved graph's code depends on and its guards do not check: the file name is its digest. `family`
    leaves kvserve's source out: the same engine on the same machine after an upgrade, whose last compile time
    tells how long the next will take (CompileTimes)."""

    directory: Path
    digest: str
    family: str = ""

    @classmethod
    def of(cls, *parts: Any, subdirectory: str = "") -> GraphKey:
        """The key of graphs whose code depends on `parts` (described: `describe`), kept in the graph directory
        or a `subdirectory` of it."""
        env, described = environment(), [describe(part) for part in parts]
        text = json.dumps([env, described], sort_keys=True)
        family = json.dumps([{k: v for k, v in env.items() if k != "kvserve"}, described], sort_keys=True)
        return cls(graph_directory() / subdirectory, hashlib.sha256(text.encode()).hexdigest()[:40],
                   hashlib.sha256(family.encode()).hexdigest()[:40])

    def path(self, name: str) -> Path:
        return self.directory / f"{name}-{self.digest}.bin"


def graph_directory() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / DIRECTORY_NAME


def environment() -> dict[str, str]:
    """What every graph depends on: kvserve's source, torch, Python, the machine, Inductor's settings and torch's
    thread count now. Dynamo guards the thread count, so a graph saved by a process with other threads loads but
    takes no call (each would be run eagerly): such a process names, compiles and saves graphs of its own."""
    from kvserve.inductor_isa import machine_key

    return {"kvserve": source_digest(), "torch": torch.__version__, "python": sys.version, "machine": machine_key(),
            "inductor": _digest(torch._inductor.config.save_config_portable()), "threads": str(torch.get_num_threads())}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """The digest of every Python file of the kvserve package (its path and bytes): any edit names new graphs."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _digest(config: dict) -> str:
    return hashlib.sha256(repr(sorted((k, repr(v)) for k, v in config.items())).encode()).hexdigest()


def owned(obj: Any) -> bool:
    """A module, a dataclass or one of kvserve's objects: described field by field (describe, engine_objects). Not
    a GraphSet (a KV format's kernel, which the cache holds): its graphs are named by their own key, and what they
    hold differs between a start that compiled them and one that loaded them."""
    kind = type(obj).__module__
    return not isinstance(obj, GraphSet) and (isinstance(obj, torch.nn.Module) or kind.startswith("kvserve.") or
                                              (dataclasses.is_dataclass(obj) and not isinstance(obj, type)))


def fields(obj: Any) -> dict[str, Any]:
    return dict(vars(obj)) if hasattr(obj, "__dict__") else {name: getattr(obj, name) for name in obj.__slots__}


def describe(obj: Any, seen: set[int] | None = None) -> Any:
    """A JSON-able account of what a traced graph can bake in from `obj`: for a module or one of kvserve's objects,
    its class and every attribute; for a tensor its dtype, shape, strides, offset and device, never its values (a
    graph reads those at every call); numbers, strings and flags as they are; any other object its class only.
    An object met again is named, not described again."""
    seen = set() if seen is None else seen
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return ["tensor", str(obj.dtype), list(obj.shape), list(obj.stride()), obj.storage_offset(),
                str(obj.device), type(obj).__name__]
    if isinstance(obj, (list, tuple)):
        return [describe(item, seen) for item in obj]
    if isinstance(obj, dict):
        return {str(k): describe(v, seen) for k, v in obj.items()}
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):  # a function, a class
        return _describe_function(obj, seen)
    if not owned(obj):
        return kind
    if id(obj) in seen:
        return f"seen {kind}"
    seen.add(id(obj))
    return {"class": kind, **{name: describe(value, seen) for name, value in sorted(fields(obj).items())}}


def _describe_function(function: Any, seen: set[int]) -> Any:
    """A function or class by its name; a nested function with the values its closure holds as well (a block size,
    a number of bits: a traced graph bakes them in, and a saved one keeps them)."""
    name = f"{getattr(function, '__module__', '')}.{function.__qualname__}"
    closure = getattr(function, "__closure__", None)
    if not closure or id(function) in seen:
        return name
    seen.add(id(function))
    values = []
    for cell in closure:
        try:
            values.append(describe(cell.cell_contents, seen))
        except ValueError:  # a cell not yet filled
            values.append("empty cell")
    return {"function": name, "closure": values}
