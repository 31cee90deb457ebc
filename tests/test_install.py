"""What `pip install -e .` brings: every package kvserve imports, nothing it does not, and nothing to compile."""
import ast
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Declared but never imported by kvserve: transformers refuses to load a GGUF without it.
USED_THROUGH_TRANSFORMERS = {"accelerate"}
# Import names of declared packages this machine may lack (llama-cpp-python compiles for minutes).
NOT_INSTALLED_HERE = {"llama_cpp": "llama-cpp-python"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def _imported_distributions(directory: Path) -> set[str]:
    """Distributions of the third-party packages imported anywhere under `directory` (top level or in a function)."""
    modules = set()
    for file in directory.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.partition(".")[0])
    third_party = modules - set(sys.stdlib_module_names) - {"__future__", "kvserve", "tests"}
    installed = packages_distributions()
    return {_canonical(NOT_INSTALLED_HERE.get(m) or installed.get(m, [m])[0]) for m in third_party}


def test_kvserve_imports_exactly_its_declared_dependencies():
    runtime = _names(PROJECT["dependencies"])
    extras = {name for extra, requirements in PROJECT["optional-dependencies"].items() if extra != "test"
              for name in _names(requirements)}

    imported = _imported_distributions(REPO / "kvserve")

    assert imported - runtime - extras == set(), "imported by kvserve but in neither dependencies nor an extra"
    assert runtime - imported == USED_THROUGH_TRANSFORMERS, "declared but never imported"


def test_tests_import_only_declared_dependencies():
    declared = _names(PROJECT["dependencies"]) | _names(PROJECT["optional-dependencies"]["test"])

    assert _imported_distributions(REPO / "tests") - declared == set()


@pytest.fixture(scope="module")
def fresh_pip(tmp_path_factory) -> list:
    """pip of a new, empty venv, with no cache."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    return [venv / "bin" / "python", "-m", "pip", "--no-cache-dir"]


def _skip_if_offline(pip: list, tmp_path: Path, target: str) -> None:
    probe = subprocess.run([*pip, "download", "--no-deps", "-d", tmp_path / "probe", "pip"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"NOT CHECKED: the package index cannot be reached, so whether `pip install -e {target}` "
                    f"compiles anything is unknown. pip said: {(probe.stderr.strip().splitlines() or ['nothing'])[-1]}")


@pytest.mark.network
@pytest.mark.parametrize("target", [".", ".[test]"])
def test_fresh_install_needs_no_compiler(fresh_pip, tmp_path, target):
    """Resolve the install in a new venv (`--dry-run`: nothing is built or installed), with this machine's own
    pip configuration, and check that every package comes as a wheel, not as a source archive to build."""
    report = tmp_path / "report.json"
    result = subprocess.run([*fresh_pip, "install", "--dry-run", "--report", report, "-e",
                             f"{REPO}{target.removeprefix('.')}"], capture_output=True, text=True)
    if result.returncode != 0:
        _skip_if_offline(fresh_pip, tmp_path, target)
    assert result.returncode == 0, result.stderr

    installs = json.loads(report.read_text())["install"]
    not_wheels = {item["metadata"]["name"]: item["download_info"]["url"] for item in installs
                  if not item["download_info"].get("dir_info", {}).get("editable")
                  and not item["download_info"]["url"].endswith(".whl")}

    assert not_wheels == {}, "source archives: pip would build (compile) these"
    assert {"kvserve", "torch", "transformers"} <= {_canonical(i["metadata"]["name"]) for i in installs}
