"""kvserve as released software: one version everywhere, a license, and an sdist and wheel that rebuild and install.

The installed wheel running outside the checkout is .ci/check_wheel.sh's job (CI runs it before the tests)."""
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from kvserve import __version__
from kvserve.cli import main
from tests.conftest import make_tiny_model, save_char_tokenizer, serve_tiny

REPO = Path(__file__).resolve().parents[1]


BUILD_OUTPUT = ("__pycache__", ".pytest_cache", "build", "dist")


def source_files() -> list[str]:
    """The checkout's files (git's tracked and new ones), or in an unpacked sdist every file but build output."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = [str(path.relative_to(REPO)) for path in REPO.rglob("*")
                  if not any(part in BUILD_OUTPUT or part.endswith(".egg-info") for part in path.parts)]
    return [name for name in listed if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build` of a copy of the checkout's files (an egg-info left in the checkout by `pip install -e`
    would otherwise feed the sdist): the sdist, then the wheel built from it."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def test_the_version_is_written_once():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvserve.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", __version__)


def test_kvserve_version_and_python_m_kvserve_print_it(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvserve {__version__}\n"

    result = subprocess.run([sys.executable, "-m", "kvserve", "--version"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert (result.returncode, result.stdout) == (0, f"kvserve {__version__}\n")


def test_python_m_kvserve_runs_a_subcommand(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvserve", "plan", "llama-3.1-8b", "--json"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert '"kv_bytes_per_token": 131072' in result.stdout


def test_the_server_reports_its_version_without_the_key_and_logs_it_at_start_up(tmp_path, caplog):
    model = save_char_tokenizer(make_tiny_model(tmp_path / "tiny-llama"))
    caplog.set_level(logging.INFO, logger="kvserve")
    with serve_tiny(model, {"kv_cache_memory": "8MiB"}, api_key="secret") as server:
        response = httpx.get(server.url + "/version")
        assert (response.status_code, response.json()) == (200, {"version": __version__})
        assert httpx.get(server.url + "/v1/models").status_code == 401  # the key still guards the API
    assert f"kvserve {__version__} serving tiny-llama" in caplog.messages


def test_the_sdist_holds_what_a_rebuild_and_its_tests_need(dist):
    (sdist,) = dist.glob("kvserve-*.tar.gz")
    root = f"kvserve-{__version__}"
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(f"{root}/") for name in archive.getnames()}
        pkg_info = archive.extractfile(f"{root}/PKG-INFO").read().decode()
        license_text = archive.extractfile(f"{root}/LICENSE").read().decode()
    needed = {"pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md", ".ci/run", ".ci/check_wheel.sh",
              *(name for name in source_files() if name.split("/")[0] in ("kvserve", "tests", "docs"))}

    assert needed - names == set()
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    assert f"\nVersion: {__version__}\n" in pkg_info
    assert license_text == (REPO / "LICENSE").read_text()


def test_the_wheel_carries_the_license_the_version_and_the_package_data(dist):
    (wheel,) = dist.glob(f"kvserve-{__version__}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"kvserve-{__version__}.dist-info/METADATA").decode()
        entry_points = archive.read(f"kvserve-{__version__}.dist-info/entry_points.txt").decode()

    assert f"\nVersion: {__version__}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "\nClassifier: Topic :: Scientific/Engineering :: Artificial Intelligence\n" in metadata
    assert f"kvserve-{__version__}.dist-info/licenses/LICENSE" in names
    assert "kvserve = kvserve.cli:main" in entry_points
    assert {"kvserve/__main__.py", "kvserve/planner/presets/llama-3.1-8b.json",
            "kvserve/server/static/dashboard.html"} <= names
    assert not [name for name in names if name.startswith("tests/")]


def test_the_license_is_the_apache_2_0_text():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_the_changelog_has_an_unreleased_section_above_every_release():
    headings = re.findall(r"^## (.+)$", (REPO / "CHANGELOG.md").read_text(), flags=re.MULTILINE)
    assert headings[0].startswith("Unreleased")
    released = [tuple(map(int, re.match(r"(\d+)\.(\d+)\.(\d+) ", heading).groups())) for heading in headings[1:]]
    assert released == sorted(released, reverse=True) and (0, 1, 0) in released
    assert released[0] < tuple(map(int, __version__.split(".")[:3]))  # the version now is the one being made
