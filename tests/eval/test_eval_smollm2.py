"""On the embedded SmolLM2: the reference setting's perplexity equals transformers' on the same windows (0.1%)."""
import json

import pytest

from kvserve.cli import main
from kvserve.model.loader import resolve_model
from tests.eval.test_eval_cli import TEXT, transformers_ppl


@pytest.mark.slow
def test_reference_perplexity_matches_transformers(capsys, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT)
    assert main(["eval", "--corpus", str(corpus), "--tokens", "300", "--context", "128", "--stride", "64",
                 "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    from transformers import AutoTokenizer

    path = resolve_model(None).path
    token_ids = AutoTokenizer.from_pretrained(path)(TEXT).input_ids[:300]
    assert row["tokens_scored"] == 299
    assert row["ppl"] == pytest.approx(transformers_ppl(path, token_ids, 128, 64), rel=1e-3)
