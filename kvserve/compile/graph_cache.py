"""What the engine's compiled steps keep beside their saved graphs (kvserve/saved_graphs.py): the engine's objects a
graph refers to by name rather than holding copies (its weights and layers), and how long the last compile of an
engine took on this machine, so that a start which must compile can say beforehand about how long it will take."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from kvserve.private_files import not_private, write_private
from kvserve.saved_graphs import GraphKey, fields, first_line, owned

logger = logging.getLogger("kvserve")


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
        elif owned(obj):
            seen.add(id(obj))
            found[path] = obj
            for name, value in fields(obj).items():
                walk(f"{path}.{name}", value)

    for name, root in roots.items():
        walk(name, root)
    return found
