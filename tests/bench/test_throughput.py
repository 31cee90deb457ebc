"""`kvserve bench throughput` without llama-cpp-python (the `[bench]` extra): it says so and runs the rest."""
import pytest

from kvserve.bench import llama_cpp_baseline
from kvserve.cli import main

TINY_RUN = ["bench", "throughput", "--num-requests", "2", "--min-prompt-len", "8", "--max-prompt-len", "8",
            "--output-len", "2", "--dtypes", "float32", "--skip", "transformers", "single"]


@pytest.mark.slow
def test_missing_llama_cpp_is_named_with_its_install_command(monkeypatch, capsys):
    monkeypatch.setattr(llama_cpp_baseline, "llama_cpp_installed", lambda: False)

    assert main(TINY_RUN) == 0

    out = capsys.readouterr().out
    assert "llama.cpp: not installed (pip install -e '.[bench]')" in out
    assert "kvserve (float32)" in out  # the table still comes, with kvserve's row
    assert "did not run" not in out and "llama-cpp-python process failed" not in out
