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


def test_times_a_stream_alone_and_beside_pollers_of_the_block_view(tmp_path, capsys):
    from tests.conftest import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "tiny-chat")  # the stream's prompt is text
    argv = ["bench", "dashboard", "--model", str(model), "--kv-cache-memory", "1MiB", "--max-model-len", "512",
            "--num-seqs", "4", "--polls", "2", "--pollers", "3", "--stream-tokens", "40", "--rounds", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "one 40-token stream, 128-block pool, 1 rounds:" in out
    assert re.search(r"  alone: [\d.]+ s median of [\d.]+; gaps between chunks over 10 ms: \d+ of \d+", out)
    polled = re.search(r"the pollers got (\d+) answers from (\d+) views of the pool; the stream took [+-][\d.]+%", out)
    answers, views = map(int, polled.groups())
    assert answers >= 3 and views < answers  # one answer per poller at least; they share views
