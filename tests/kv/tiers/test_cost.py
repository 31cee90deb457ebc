"""Read or recompute: reading is tried until both rates are measured; then a prefix is read only where that is
faster than prefilling its tokens, and the tokens prefilled instead are counted and the first time logged. A rate
follows the last ten or so measurements."""
import logging

from kvserve.kv.tiers.cost import ReadCost


def test_reading_is_tried_until_both_rates_are_measured():
    cost = ReadCost()
    assert cost.worth_reading(100_000, 16)
    cost.note_prefill(1000, 1.0)
    assert cost.worth_reading(100_000, 16) and cost.num_recomputed_tokens == 0


def test_a_slow_read_is_recomputed_counted_and_logged_once(caplog):
    cost = ReadCost()
    cost.note_read(1000, 1.0)  # 1 kB/s
    cost.note_prefill(1000, 1.0)  # 1,000 tokens/s
    assert cost.worth_reading(1000, 1000)  # 1 s either way: read
    with caplog.at_level(logging.INFO, logger="kvserve"):
        assert not cost.worth_reading(2000, 1000) and not cost.worth_reading(4000, 16)
    assert cost.num_recomputed_tokens == 1016
    assert caplog.text.count("rather than reading them") == 1 and "kv_disk_cache_recomputed_tokens" in caplog.text


def test_rates_are_exponential_averages():
    cost = ReadCost()
    cost.note_read(1000, 1.0)
    cost.note_read(2000, 1.0)
    assert cost.read_bytes_per_s == 0.9 * 1000 + 0.1 * 2000
    cost.note_read(100, 0.0)  # a read timed as instant is capped, not a division by zero
    assert cost.read_bytes_per_s == 0.9 * 1100 + 0.1 * (100 / 1e-6)
