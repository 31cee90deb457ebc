"""`kvserve bench multiturn --tiers` on a tiny model: the disk tier computes little more than the new input where
the pool alone recomputes whole histories, and after the restart the returning turns still find their history;
`--plot` draws the three runs, and a bad plot path stops the command before it benchmarks anything."""
import pytest

from kvserve.bench import tiers
from kvserve.bench.tiers import TierWorkload, run_tiers
from kvserve.cli import main
from kvserve.kv.tiers.disk import DiskKVCache
from tests.conftest import image_size, make_tiny_model

TIERS = ["bench", "multiturn", "--tiers", "--conversations", "2", "--turns", "3", "--restart-after", "2",
         "--first", "40", "--question", "8", "--answer", "2"]


def test_the_disk_tier_rows_compute_the_new_input_and_survive_the_restart(tmp_path, capsys, monkeypatch):
    # A tiny model prefills faster than it reads its tiny records, so the engine may rightly choose to recompute
    # (tests/engine/test_disk_tier.py tests that choice); here every prefix the disk holds is read.
    monkeypatch.setattr(DiskKVCache, "worth_reading", lambda self, *records_and_tokens: True)
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=2048)
    workload = TierWorkload(conversations=4, turns=4, first_tokens=300, question_tokens=50, answer_tokens=8,
                            restart_after=2, pool_share=0.3)
    pool, disk, restarted = run_tiers(workload, str(model), disk_dir=str(tmp_path / "kv"), sequential_bytes=16 << 20)
    assert pool.new_tokens == disk.new_tokens == 4 * (300 + 3 * 50)
    assert pool.prefilled_tokens > 3 * pool.new_tokens  # evicted between turns: whole histories again
    assert disk.prefilled_tokens <= 1.25 * disk.new_tokens and restarted.prefilled_tokens == disk.prefilled_tokens
    for run in (disk, restarted):
        assert sum(t.cached_tokens for t in run.returning) >= 0.9 * sum(t.history_tokens for t in run.returning)
        # read from disk, or, where the writer thread was still behind, from its queue (a loaded CI machine)
        assert (run.bytes_read > 0 or run.queued_reads > 0) and run.bytes_written > 0
    assert restarted.bytes_read > 0  # after the restart: what the process before it wrote
    assert disk.answers == pool.answers == restarted.answers
    assert "sequential read of a 16 MiB file" in capsys.readouterr().out


def test_plot_is_written(tmp_path, capsys, monkeypatch):
    # the plain read of a 512 MiB file, the command's yardstick, is not what this test checks
    monkeypatch.setattr(tiers, "_sequential_read_s", lambda directory, num_bytes: (1.0, 1.0))
    model = make_tiny_model(tmp_path / "model")
    out = tmp_path / "tiers.png"
    assert main([*TIERS, "--model", str(model), "--kv-disk-cache", str(tmp_path / "kv"), "--plot", str(out)]) == 0
    assert f"plot written to {out}" in capsys.readouterr().out
    kind, width, height = image_size(out)
    assert kind == "png" and (width, height) == (11 * 120, 504) and out.stat().st_size > 10_000


def test_a_bad_plot_path_fails_before_the_benchmark(tmp_path):
    # the model does not exist either: the plot path is checked before anything is loaded
    with pytest.raises(SystemExit, match=r"--plot .*plot\.jpg: the name must end in \.png or \.svg"):
        main([*TIERS, "--model", str(tmp_path / "no-model"), "--plot", str(tmp_path / "plot.jpg")])
