"""`kvserve --help`, every subcommand's help and `kvserve plan` run without torch, transformers or any extra.

Each runs in a fresh interpreter in which importing those packages fails loudly, so a parser that pulls one in
(directly or through a module it imports) shows up here with the import that did it."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# torch and transformers: only a command that runs a model may import them. The rest come with an extra
# (pytest, openai, tokenizers, playwright: [test]; llama_cpp: [bench]), not with `pip install -e .`.
FORBIDDEN = ("torch", "transformers", "tokenizers", "pytest", "openai", "playwright", "llama_cpp")

RUN_WITHOUT_FORBIDDEN = f"""
import sys

class Forbid:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {FORBIDDEN!r}:
            raise ModuleNotFoundError(f"{{name}} imported while building the CLI", name=name)

sys.meta_path.insert(0, Forbid())
from kvserve.cli import main
sys.exit(main(sys.argv[1:]))
"""

HELP_COMMANDS = [[], ["generate"], ["chat"], ["plan"], ["serve"], ["eval"], ["bench"], ["bench", "throughput"],
                 ["bench", "multiturn"], ["bench", "serve"], ["bench", "dashboard"], ["bench", "window"]]


def _kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_WITHOUT_FORBIDDEN, *args], cwd=REPO, capture_output=True,
                          text=True)


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "kvserve")
def test_help_imports_no_model_library_and_no_extra(command):
    result = _kvserve(*command, "--help")

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {' '.join(['kvserve', *command])}")


def test_top_level_help_lists_every_subcommand():
    help_text = _kvserve("--help").stdout

    for name in ("generate", "chat", "plan", "serve", "bench", "eval"):
        assert f"    {name}" in help_text


def test_plan_runs_without_torch():
    result = _kvserve("plan", "llama-3.1-8b", "--gpu", "h100-80", "--json")

    assert result.returncode == 0, result.stderr
    assert '"kv_bytes_per_token": 131072' in result.stdout  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
