"""Inductor's vector-ISA probe, answered once per machine instead of at every start.

Before it generates C++ for the CPU, Inductor checks each vector instruction set the CPU's flags allow (AMX,
AVX-512 VNNI, AVX-512, AVX2): it builds a tiny library with that ISA's flags (cached on disk) and loads it in a
child Python process, one child per ISA, at every start. On the 2-core Intel Xeon that is ~1.5 s of a cached start
of `--compile-decode` (its 10 `subprocess.run` calls, in cProfile), for an answer that only changes with the CPU,
the compiler, Python or torch.

`remember_vec_isa_probe()` records the answer in a JSON file in Inductor's cache directory, keyed by those four.
When every ISA the CPU's flags allow loaded, later starts with the same key set Inductor's `cpp.vec_isa_ok`,
which takes them all as valid without probing: Inductor then picks the same ISA as its probe did, and the libraries
its ISA extensions' checks load are answered from the record too (`_remember_library_loads`). If any failed,
nothing is set and Inductor probes as usual. A `vec_isa_ok` set by the user is left alone."""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path

RECORD_NAME = "kvserve-vec-isa.json"


def remember_vec_isa_probe() -> bool | None:
    """Answer Inductor's ISA probe from the record, or probe now and record it. Returns whether every ISA the CPU
    allows is valid (None: not an x86 Linux machine, or the user set vec_isa_ok: nothing done)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor import config

    if config.cpp.vec_isa_ok is not None:
        return None
    allowed = _allowed_isas()
    key = _fingerprint(allowed)
    path = _record_path()
    record = _read(path)
    _remember_library_loads(key, path)
    if record.get(key) is True:
        config.cpp.vec_isa_ok = True
        return True
    valid = all(bool(isa) for isa in allowed)  # Inductor's own probe, one child process per ISA (cached per process)
    record = _read(path)  # with the libraries the probe loaded
    record[key] = valid
    _write(path, record)
    if valid:
        config.cpp.vec_isa_ok = True
    return valid


def machine_key() -> str:
    """This machine as Inductor's generated code depends on it: the vector instruction sets its CPU allows, the C++
    compiler, Python and torch (kvserve/saved_graphs.py names saved graphs by it)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"{sys.platform} {platform.machine()} {platform.processor()}"
    return _fingerprint(_allowed_isas())


def _remember_library_loads(key: str, path: Path) -> None:
    """vec_isa_ok answers the probe of each ISA, but an ISA with extensions (AVX-512's BF16 and VNNI) still builds
    a library per extension and loads it in a child process at every start: three child Pythons on the AVX-512
    EPYC (its subprocess.run calls). Each library that loaded is recorded under this machine's key; a later start
    with that key takes a recorded library that is still there as loaded, and loads any other as Inductor would."""
    from torch._inductor import cpu_vec_isa

    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is None or getattr(probe, "remembered_by_kvserve", False):
        return

    def probe_load(isa, output_path: str) -> bool:
        entry = f"{key} | loaded {output_path}"
        record = _read(path)
        if record.get(entry) is True and os.path.isfile(output_path):
            return True
        loaded = probe(isa, output_path)
        if loaded:
            record[entry] = True
            _write(path, record)
        return loaded

    probe_load.remembered_by_kvserve = True
    cpu_vec_isa.VecISA._probe_load = probe_load


def _allowed_isas() -> list:
    """The ISAs Inductor would probe: those whose flags the CPU has."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def _fingerprint(allowed: list) -> str:
    """What the probe's answer depends on: the ISAs, the C++ compiler (its file), Python and torch."""
    import torch
    from torch._inductor import cpp_builder

    compiler = cpp_builder.get_cpp_compiler()
    found = shutil.which(compiler) or compiler
    try:
        stat = os.stat(os.path.realpath(found))
        compiler_id = f"{os.path.realpath(found)}:{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        compiler_id = found
    return " | ".join([",".join(str(isa) for isa in allowed), compiler_id, sys.version.split()[0], torch.__version__,
                       os.path.dirname(torch.__file__)])


def _record_path() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / RECORD_NAME


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in record.items() if isinstance(k, str) and isinstance(v, bool)} \
        if isinstance(record, dict) else {}


def _write(path: Path, record: dict) -> None:
    """Atomically (another process may start beside this one); a cache that cannot be written is only slower."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, path)
    except OSError:
        pass
