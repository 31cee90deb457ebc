"""`kvserve eval` end to end on a tiny model: the reference's perplexity is transformers' on the same windows, a
setting against itself scores KLD 0 and full agreement, a lossy format does not, streaming mode reports what it
cannot compare, and bad arguments give one line and exit code 2 with nothing written."""
import json
import math

import pytest
import torch
import transformers

from kvserve.cli import main
from kvserve.eval.windows import sliding_windows
from tests.conftest import char_tokenizer, make_tiny_model, save_char_tokenizer
from tests.model.test_qwen3_next import make_hybrid_model

TEXT = ("The cache holds keys and values of every earlier token. A block holds sixteen of them, and a table "
        "of blocks says where a request's tokens live. Sharing a prefix means sharing its blocks. ") * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("eval-model"), "llama-gqa", max_position_embeddings=256)
    return save_char_tokenizer(directory)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-corpus") / "text.txt"
    path.write_text(TEXT)
    return path


def run_json(capsys, *argv) -> list[dict]:
    assert main(["eval", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def transformers_ppl(model_dir, token_ids: list[int], context: int, stride: int) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for w in sliding_windows(len(token_ids), context, stride):
        ids = torch.tensor([token_ids[w.start : w.end]])
        with torch.no_grad():
            logprobs = model(ids).logits[0].log_softmax(-1)
        targets = ids[0, -w.num_scored :]
        nll -= float(logprobs[-w.num_scored - 1 : -1].gather(1, targets[:, None]).sum())
        count += w.num_scored
    return math.exp(nll / count)


def test_reference_matches_transformers_and_a_setting_matches_itself(capsys, model_dir, corpus):
    rows = run_json(capsys, "--model", str(model_dir), "--corpus", str(corpus), "--tokens", "400", "--context",
                    "128", "--stride", "48", "--kv-cache-dtype", "auto,float32,int8")
    auto, same, int8 = rows
    token_ids = char_tokenizer()(TEXT).input_ids[:400]
    assert auto["ppl"] == pytest.approx(transformers_ppl(model_dir, token_ids, 128, 48), rel=1e-3)
    assert auto["tokens_scored"] == same["tokens_scored"] == int8["tokens_scored"] == 399
    assert same["kld"] == 0 and same["top1_agreement"] == 1 and same["delta_ppl_pct"] == 0
    assert int8["kld"] > 0 and int8["bytes_per_token"] < auto["bytes_per_token"]
    assert auto["corpus"] == "text.txt" and len(auto["corpus_sha256"]) == 64 and auto["passkey_accuracy"] is None
    assert {"setting", "kv_cache_dtype", "kv_eviction", "bytes_per_token", "ppl", "delta_ppl_pct", "kld",
            "top1_agreement", "tokens_scored", "passkey_accuracy"} <= set(auto)


def test_weight_quantization_is_a_setting_compared_with_the_float_reference(capsys, model_dir, corpus):
    rows = run_json(capsys, "--model", str(model_dir), "--corpus", str(corpus), "--tokens", "200", "--context",
                    "128", "--stride", "64", "--quantization", "none,int8")
    none, int8 = rows
    assert (none["quantization"], int8["quantization"]) == ("none", "int8")
    assert int8["setting"] == "int8 weights + auto" and none["kld"] == 0
    assert int8["kld"] > 0 and int8["tokens_scored"] == none["tokens_scored"]


def test_streaming_mode_runs_past_max_model_len_and_says_what_it_cannot_compare(capsys, model_dir, corpus):
    rows = run_json(capsys, "--model", str(model_dir), "--corpus", str(corpus), "--tokens", "500", "--streaming",
                    "--max-model-len", "256", "--chunk", "64", "--segment", "128",
                    "--kv-eviction", "none,streaming", "--kv-recent-tokens", "96")
    full, streaming = rows
    assert full["ppl"] is None and "exceed max_model_len" in full["not_available"]["ppl"]
    assert streaming["ppl"] > 0 and streaming["tokens_scored"] == 499 and len(streaming["ppl_by_segment"]) == 4
    assert streaming["kld"] is None and "no reference" in streaming["not_available"]["kld"]
    assert streaming["max_tokens_per_sequence"] == (1 + 6 + 1) * 16


def test_passkey_and_plot(capsys, model_dir, corpus, tmp_path):
    plot = tmp_path / "quality.png"
    rows = run_json(capsys, "--model", str(model_dir), "--corpus", str(corpus), "--tokens", "200", "--context",
                    "128", "--stride", "64", "--kv-cache-dtype", "auto,int4", "--passkey-lengths", "150",
                    "--passkey-trials", "2", "--plot", str(plot))
    for row in rows:
        assert row["passkey_by_length"].keys() == {"150"} and 0 <= row["passkey_accuracy"] <= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "auto,int3"], "kv_cache_dtype='int3' is not supported"),
    (["--quantization", "none,int4"], "quantization='int4' is not supported; choose one of none, int8"),
    (["--context", "512"], "--context 512 exceeds max_model_len 256"),
    (["--stride", "128"], "stride (128) must be positive and smaller than context (128)"),
    (["--corpus", "/nonexistent/text.txt"], "cannot read corpus"),
    (["--setting", "kv_cache_dtype"], "expected name=value pairs"),
    (["--plot", "out.jpg"], "must end in .png or .svg"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, model_dir, corpus, argv, message):
    default = ["--model", str(model_dir), "--corpus", str(corpus), "--tokens", "200", "--context", "128", "--stride", "64"]
    assert main(["eval", *default, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.startswith("kvserve eval: error:")]
    assert len(lines) == 1 and message in lines[0]


def test_an_empty_corpus_is_refused(capsys, model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["eval", "--model", str(model_dir), "--corpus", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_a_hybrid_model_is_evaluated_as_transformers_scores_it(capsys, tmp_path, corpus):
    # Gated DeltaNet layers beside full attention: every window is prefilled from a fresh state slot
    model_dir = save_char_tokenizer(make_hybrid_model(tmp_path / "hybrid", "qwen3_next"))
    reference, int8 = run_json(capsys, "--model", str(model_dir), "--corpus", str(corpus), "--tokens", "300",
                               "--context", "128", "--stride", "48", "--kv-cache-dtype", "auto,int8")
    token_ids = char_tokenizer()(TEXT).input_ids[:300]
    assert reference["ppl"] == pytest.approx(transformers_ppl(model_dir, token_ids, 128, 48), rel=1e-3)
    assert int8["kld"] > 0 and int8["tokens_scored"] == reference["tokens_scored"] == 299
