"""`kvserve bench dashboard` on a tiny model: it fills the pool as asked, times both parts and prints the share of
a core; its sequences are gone afterwards (the leak check in conftest.py)."""
import re

import pytest

from kvserve.cli import main
from tests.conftest import make_tiny_model


def test_reports_the_cost_of_a_refresh_on_the_pool_it_filled(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "tiny")
    argv = ["bench", "dashboard", "--model", str(model), "--kv-cache-memory", "1MiB", "--max-model-len", "512",
            "--fill", "0.5", "--num-seqs", "4", "--polls", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pool: 128 blocks × 16 tokens; 64 held by 4 running sequences (50%); 3 refreshes" in out
    per_refresh_ms = float(re.search(r"at one refresh a second: ([\d.]+) ms of CPU per second", out).group(1))
    share = float(re.search(r"= ([\d.]+)% of one core", out).group(1))
    assert per_refresh_ms > 0 and share == pytest.approx(per_refresh_ms / 10, abs=0.006)
