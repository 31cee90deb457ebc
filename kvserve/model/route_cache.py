"""The start-up probes' choices of matmul route (float_kernels.py per dtype, int8_kernels.py) remembered on disk, so
that a later start on the same machine reads the choice instead of timing the routes again.

The file is JSON (never pickle), beside the saved compiled graphs (Inductor's cache directory, `kvserve-graphs`),
one entry per probe and model shapes ("int8 <digest of the shapes>", "float32 ...": probe_shapes.py). An entry holds
the key it was probed under: the CPU (model name, family and model, its vector-ISA flags and PyTorch's CPU
capability), PyTorch's version and build, the threads a matmul runs on, the digest of the kernel modules' source, the
model's matrix shapes and the probe's sizes: everything that changes which route wins or what a route computes. A
start whose key differs probes again and writes the entry over, with a warning that names what changed; so does one
that finds the file truncated, of the wrong types, naming a route it does not know, or not private (owned by another
user, or writable by others: then it is not trusted, and not written over)."""
from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import platform
import re
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvserve.model.probe_shapes import WeightShapes
from kvserve.private_files import not_private, write_private

logger = logging.getLogger("kvserve")

DIRECTORY_NAME = "kvserve-graphs"  # kvserve/saved_graphs.py's directory: the routes are kept with the graphs
FILE_NAME = "matmul-routes.json"
SCHEMA = 1
ENTRY_FIELDS = {"key", "route", "speedup_by_rows", "probed_at"}
# the CPU flags that name vector instruction sets a route may use (AVX-512 VNNI, AMX, ...)
ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse")
# beside this file: what a route computes and how the probes time it
SOURCES = ("float_kernels.py", "int8_kernels.py", "probe_shapes.py", "route_cache.py")


@dataclass(frozen=True)
class Remembered:
    """A probe's choice as the file holds it: the route's name, its speedups and when (UTC) it was probed."""

    route: str
    speedup_by_rows: dict[int, float]
    probed_at: str


def route_file() -> Path:
    return cache_root() / DIRECTORY_NAME / FILE_NAME


def cache_root() -> Path:
    """Inductor's cache directory, found as Inductor finds it (TORCHINDUCTOR_CACHE_DIR, else torchinductor_<user>
    in the temporary directory) without importing Inductor, which costs an eager start seconds."""
    if "torch._inductor.runtime.cache_dir_utils" in sys.modules:
        return Path(sys.modules["torch._inductor.runtime.cache_dir_utils"].cache_dir())
    if directory := os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(directory).absolute()
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def entry_name(probe: str, shapes: WeightShapes) -> str:
    """The probe's entry for a model of these shapes: each model structure probed keeps an entry of its own."""
    return f"{probe} {hashlib.sha256(json.dumps(shapes.key()).encode()).hexdigest()[:16]}"


def probe_key(entry: str, probe: dict) -> dict:
    """Everything the probe named `entry` depends on, as the file holds it (JSON: tuples as lists): `probe` names
    what it timed (the model's shapes, the rows, the routes)."""
    key = {"entry": entry, "cpu": cpu_identity(), "torch": torch.__version__,
           "torch_build": str(torch.version.git_version), "threads": torch.get_num_threads(),
           "sources": sources_digest(), "probe": probe}
    return json.loads(json.dumps(key))


def cpu_identity() -> dict:
    """The CPU as a route's speed depends on it: its name, family and model, vector-ISA flags, PyTorch's view."""
    info = _cpuinfo()
    flags = sorted(flag for flag in info.get("flags", "").split() if flag.startswith(ISA_FLAG_PREFIXES))
    return {"model_name": info.get("model name", platform.processor()), "family": info.get("cpu family", ""),
            "model": info.get("model", ""), "flags": flags, "machine": platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def sources_digest() -> str:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return digest.hexdigest()


def recall(entry: str, key: dict, routes: set[str]) -> Remembered | None:
    """The remembered choice for `entry` if the file holds one probed under `key` naming one of `routes`; else None,
    with a warning where there was something that could not be used."""
    path = route_file()
    entries, problem = read_entries(path)
    found = entries.get(entry)
    if problem is None and found is not None:
        problem = entry_problem(found, key, routes)
        if problem is None:
            speedups = {int(rows): float(s) for rows, s in found["speedup_by_rows"].items()}
            return Remembered(found["route"], speedups, found["probed_at"])
    if problem is not None:
        logger.warning(f"remembered {entry} matmul route in {path} not used ({problem}); probing again")
    return None


def remember(entry: str, key: dict, route: str, speedup_by_rows: dict[int, float]) -> None:
    """Write this process's probe of `entry` into the file (the other entries kept where the file is sound)."""
    path = route_file()
    if not_private(path) is not None:
        return  # another user's file or directory, or one others may write: left alone
    entries, _ = read_entries(path)
    entries[entry] = {"key": key, "route": route, "speedup_by_rows": {str(m): s for m, s in speedup_by_rows.items()},
                      "probed_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        write_private(path, json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only cache: this start probed, the next probes again
        logger.warning(f"matmul route not remembered in {path} ({exc}); the next start probes again")


def read_entries(path: Path) -> tuple[dict[str, dict], str | None]:
    """The file's entries and why it cannot be used (None: it can, or there is no file yet)."""
    if not path.exists():
        return {}, None
    if (untrusted := not_private(path)) is not None:
        return {}, untrusted
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return {}, f"unreadable: {type(exc).__name__}"
    if not isinstance(record, dict) or record.get("schema") != SCHEMA or not isinstance(record.get("entries"), dict):
        return {}, f"not a schema-{SCHEMA} route file"
    return record["entries"], None


def entry_problem(found: object, key: dict, routes: set[str]) -> str | None:
    """Why an entry cannot be trusted for `key` (None: it can)."""
    if not isinstance(found, dict) or set(found) != ENTRY_FIELDS:
        return "an entry of the wrong form"
    if not isinstance(found["key"], dict):
        return "an entry of the wrong form"
    if changed := sorted(name for name in key.keys() | found["key"].keys() if found["key"].get(name) != key.get(name)):
        return f"probed under another {', '.join(changed)}"
    if not isinstance(found["route"], str) or found["route"] not in routes:
        return f"unknown route {found['route']!r}"
    speedups = found["speedup_by_rows"]
    if not isinstance(speedups, dict) or not all(
            isinstance(rows, str) and rows.isdigit() and isinstance(s, (int, float)) and not isinstance(s, bool)
            and s > 0 for rows, s in speedups.items()):
        return "speedups of the wrong form"
    if not isinstance(found["probed_at"], str):
        return "a probe date of the wrong form"
    return None
