"""`kvserve bench mla` end to end on a tiny MLA model: the bytes it prints are the planner's, and every timing row
is there."""
import re

from kvserve.cli import main
from tests.model.test_deepseek import make_deepseek


def test_bench_mla_prints_bytes_and_both_ways_of_attending(tmp_path, capsys):
    model = make_deepseek(tmp_path, "v2-lite")
    status = main(["bench", "mla", "--model", str(model), "--contexts", "40,70", "--batch", "2", "--steps", "3",
                   "--prefill-tokens", "50", "--prefill-chunks", "16,50"])
    out = capsys.readouterr().out
    assert status == 0
    # 3 layers x (latent 32 + rope 8) x 4 B; expanded: 3 layers x 4 heads x (K 16 + 8, V 12) x 4 B
    assert "latent (kvserve): 480 B/token, 2,236,962 tokens per GiB" in out
    assert "expanded per-head K/V: 1,728 B/token, 621,378 tokens per GiB" in out
    assert "the latent holds 3.6x the tokens" in out
    for context in ("40", "70"):
        assert re.search(rf"decode, 2 x {context}-token context: absorbed [\d.]+ tokens/s, expanded [\d.]+ "
                         r"tokens/s", out)
    for chunk, way in (("16", "absorbed"), ("50", "expanded")):  # the tiny model absorbs up to 24 queries
        assert re.search(rf"prefill, one 50-token prompt in chunks of {chunk}: absorbed [\d,]+ tokens/s, expanded "
                         rf"[\d,]+ tokens/s \([\d.]+x\); auto: {way}", out)
    assert "auto absorbs groups of up to 24 queries per request" in out
