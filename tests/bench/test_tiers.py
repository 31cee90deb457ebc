"""`kvserve bench multiturn --tiers` on a tiny model: the disk tier computes little more than the new input where
the pool alone recomputes whole histories, and after the restart the returning turns still find their history."""
from kvserve.bench.tiers import TierWorkload, run_tiers
from kvserve.kv.disk_cache import DiskKVCache
from tests.conftest import make_tiny_model


def test_the_disk_tier_rows_compute_the_new_input_and_survive_the_restart(tmp_path, capsys, monkeypatch):
    # A tiny model prefills faster than it reads its tiny records, so the engine may rightly choose to recompute
    # (tests/engine/test_disk_tier.py tests that choice); here every prefix the disk holds is read.
    monkeypatch.setattr(DiskKVCache, "worth_reading", lambda self, num_records, num_tokens: True)
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=2048)
    workload = TierWorkload(conversations=4, turns=4, first_tokens=300, question_tokens=50, answer_tokens=8,
                            restart_after=2, pool_share=0.3)
    pool, disk, restarted = run_tiers(workload, str(model), disk_dir=str(tmp_path / "kv"), sequential_bytes=16 << 20)
    assert pool.new_tokens == disk.new_tokens == 4 * (300 + 3 * 50)
    assert pool.prefilled_tokens > 3 * pool.new_tokens  # evicted between turns: whole histories again
    assert disk.prefilled_tokens <= 1.25 * disk.new_tokens and restarted.prefilled_tokens == disk.prefilled_tokens
    for run in (disk, restarted):
        assert sum(t.cached_tokens for t in run.returning) >= 0.9 * sum(t.history_tokens for t in run.returning)
        assert run.bytes_read > 0 and run.bytes_written > 0
    assert disk.answers == pool.answers == restarted.answers
    assert "sequential read of a 16 MiB file" in capsys.readouterr().out
