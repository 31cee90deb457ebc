"""The compiled step graphs kept on disk whole, so that a later start of the same engine loads them instead of
tracing the model again: torch.compile's own caches keep what Inductor generates but not Dynamo's work, which every
start repeated, while torch's AOT precompile saves a graph with Dynamo's bytecode and guards, and a loaded graph runs
no Dynamo at all. A saved graph is named by everything its code depends on and its guards do not check (GraphKey:
kvserve's source, torch, Python, the machine, Inductor's settings, the graph's options, the model's and cache's
structure). The files are pickles, read only from Inductor's cache directory, owned by this user and writable by no
one else; one that cannot be read is compiled again and written over. docs/architecture.md ("Compiled steps") says
more, docs/benchmarks.md (`kvserve bench startup`) what it saves."""
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

from kvserve.private_files import not_private, write_private

logger = logging.getLogger("kvserve")

DIRECTORY_NAME = "kvserve-graphs"


class GraphMiss(Exception):
    """No graph of a GraphSet takes these inputs (each graph's first failed guard)."""


class GraphSet:
    """One function's compiled graphs: each compiled for its example inputs at engine start, or loaded from disk
    where a start of the same engine saved it. A call runs the first graph whose guards take its inputs.

    With `save=False` (frozen weights, --compile-gemms: constants that torch cannot save with a graph, nor can its
    AOT precompile return such a graph), or with Inductor's caches turned off, the function is torch.compile's as
    it is, traced at every start, and a call that would compile a graph while serving is refused by Dynamo's
    fail_on_recompile stance instead."""

    def __init__(self, function: Callable, options: dict, key: GraphKey, external: dict[str, Any],
                 save: bool = True):
        self.function = function  # an engine's own copy: its globals reach that engine's model
        self.options = options
        self.key = key
        self.external = external  # the engine's objects a graph refers to by name (its layers), not saved with it
        # Inductor's caches turned off (TORCHINDUCTOR_FORCE_DISABLE_CACHES, for debugging): torch's AOT precompile
        # refuses to run, so the function is traced at every start as with frozen weights
        self.save = save and not torch._inductor.config.force_disable_caches
        self.graphs: list = []  # AOT-compiled functions (save), or the one torch.compile'd function (not save)
        self.loaded = 0  # graphs read from disk
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
        if path.exists() and (untrusted := not_private(path)) is not None:
            logger.warning(f"compiled graph {path} not loaded: {untrusted}; compiling it again")
        elif path.exists():
            try:
                with open(path, "rb") as file:
                    graph = torch.compiler.load_compiled_function(file, f_globals=self.function.__globals__,
                                                                  external_data=self.external)
            except Exception as exc:  # another torch's file, a truncated one: compiled again, written over
                logger.warning(f"compiled graph {path} could not be loaded ({first_line(exc)}); compiling it again")
            else:
                self.graphs.append(graph)
                self.loaded += 1
                return
        mark()
        compiled = torch.compile(self.function, fullgraph=True, dynamic=False, options=dict(self.options))
        graph = compiled.aot_compile((args, {}))
        self.graphs.append(graph)
        self.compiled += 1
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            graph.save_compiled_function(str(path), external_data=self.external)  # a private file (mode 0600)
        except Exception as exc:  # a full disk, a read-only cache: this start runs it, the next compiles again
            logger.warning(f"compiled graph not saved to {path} ({first_line(exc)}); the next start compiles it "
                           "again")

    def run_or_compile(self, name: str, args: tuple, mark: Callable[[], None]) -> Any:
        """Run these inputs, compiling a graph for them first if none takes them (`kvserve bench step`, never
        serving)."""
        if not self.save:
            mark()
            return self.graphs[0](*args)  # Dynamo compiles a graph if none fits
        if not any(graph.guard_check(*args) for graph in self.graphs):
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
        for graph in self.graphs:
            if graph.guard_check(*args):
                return graph.fn(*args)
        raise GraphMiss(self.why_not(args))

    def why_not(self, args: tuple) -> str:
        """Each graph's first failed guard, oldest graph first."""
        reasons = []
        for i, graph in enumerate(self.graphs):
            try:  # the guards' own account (torch 2.13 keeps it on the function's artifacts)
                failed = graph._artifacts.guard_manager.check_verbose(graph.prepare_f_locals(*args))
                parts = getattr(failed, "verbose_code_parts", None) or ["its guards"]
            except Exception:
                parts = ["its guards"]
            reasons.append(f"graph {i}: {str(parts[0]).strip()}")
        return "; ".join(reasons)[:300] or "no graph"


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
    def of(cls, *parts: Any) -> GraphKey:
        env, described = environment(), [describe(part) for part in parts]
        text = json.dumps([env, described], sort_keys=True)
        family = json.dumps([{k: v for k, v in env.items() if k != "kvserve"}, described], sort_keys=True)
        return cls(graph_directory(), hashlib.sha256(text.encode()).hexdigest()[:40],
                   hashlib.sha256(family.encode()).hexdigest()[:40])

    def path(self, name: str) -> Path:
        return self.directory / f"{name}-{self.digest}.bin"


class CompileTimes:
    """How long the last compile of an engine's graphs took on this machine, by GraphKey.family: a JSON file beside
    the graphs (numbers only, never code), so a start that must compile can say beforehand about how long it will
    take. A file that cannot be read, or holds anything but numbers, counts as empty and is written over."""

    FILE_NAME = "compile-seconds.json"

    def __init__(self, directory: Path):
        self.path = directory / self.FILE_NAME

    def read(self) -> dict[str, float]:
        try:
            if not_private(self.path) is not None:
                return {}
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))
                and not isinstance(v, bool) and 0 <= v < 1e6}

    def last(self, key: GraphKey) -> float | None:
        return self.read().get(key.family)

    def remember(self, key: GraphKey, seconds: float) -> None:
        times = self.read()
        times[key.family] = round(seconds, 1)
        try:
            write_private(self.path, json.dumps(times, sort_keys=True))
        except OSError as exc:  # a read-only cache: the next start says less, nothing else changes
            logger.warning(f"compile time not remembered in {self.path} ({first_line(exc)})")


def graph_directory() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / DIRECTORY_NAME


def environment() -> dict[str, str]:
    """What every graph depends on: kvserve's source, torch, Python, the machine, Inductor's settings now."""
    from kvserve.inductor_isa import machine_key

    return {"kvserve": source_digest(), "torch": torch.__version__, "python": sys.version, "machine": machine_key(),
            "inductor": _digest(torch._inductor.config.save_config_portable())}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """The digest of every Python file of the kvserve package (its path and bytes): any edit names new graphs."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _digest(config: dict) -> str:
    return hashlib.sha256(repr(sorted((k, repr(v)) for k, v in config.items())).encode()).hexdigest()


def engine_objects(**roots: Any) -> dict[str, Any]:
    """Every object a graph may refer to that belongs to the engine (its model's and cache's tensors, modules and
    kvserve objects), named by its path from `roots`: saved, a graph names them instead of holding copies (the
    weights); loaded, those names reach the new engine's own objects."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(path: str, obj: Any) -> None:
        if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)) or id(obj) in seen:
            return
        if isinstance(obj, torch.Tensor):
            seen.add(id(obj))
            found[path] = obj
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                walk(f"{path}[{i}]", item)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{path}[{k!r}]", v)
        elif _owned(obj):
            seen.add(id(obj))
            found[path] = obj
            for name, value in _fields(obj).items():
                walk(f"{path}.{name}", value)

    for name, root in roots.items():
        walk(name, root)
    return found


def _owned(obj: Any) -> bool:
    """A module, a dataclass or one of kvserve's objects: described field by field (describe, engine_objects)."""
    kind = type(obj).__module__
    return isinstance(obj, torch.nn.Module) or kind.startswith("kvserve.") or \
        (dataclasses.is_dataclass(obj) and not isinstance(obj, type))


def _fields(obj: Any) -> dict[str, Any]:
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
        return f"{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    if not _owned(obj):
        return kind
    if id(obj) in seen:
        return f"seen {kind}"
    seen.add(id(obj))
    return {"class": kind, **{name: describe(value, seen) for name, value in sorted(_fields(obj).items())}}
