"""`kvserve eval --tasks ruler` on a tiny model: every setting through every task and length, through the engine,
with the structure a reader relies on; bad RULER arguments give one line and exit code 2."""
import pytest

from kvserve.cli import main
from tests.conftest import make_tiny_model, save_char_tokenizer
from tests.eval.test_eval_cli import run_json


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = make_tiny_model(tmp_path_factory.mktemp("ruler-model"), "llama-gqa", max_position_embeddings=1024)
    return save_char_tokenizer(directory)


def test_ruler_runs_every_setting_through_every_task_and_length(capsys, model_dir):
    rows = run_json(capsys, "--model", str(model_dir), "--max-model-len", "1024", "--tasks", "ruler",
                    "--ruler-lengths", "700,900", "--ruler-samples", "2", "--kv-cache-dtype", "auto,int8")
    assert [row["kv_cache_dtype"] for row in rows] == ["auto", "int8"]
    for row in rows:
        assert row["ruler_lengths"] == [700, 900] and row["ruler_samples"] == 2 and row["ppl"] is None
        assert row["ruler"].keys() == {"700", "900"}
        for scores in row["ruler"].values():
            assert scores.keys() == {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"}
            assert all(0 <= value <= 1 for value in scores.values())
    passed = [value for scores in rows[0]["ruler"].values() for value in scores.values() if value >= 0.6]
    assert (rows[0]["ruler_average"] is None) == (not passed)  # random weights: the average covers what passes


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "ppl,mmlu"], "--tasks 'ppl,mmlu': choose from ppl, ruler"),
    (["--tasks", "ruler", "--ruler-tasks", "qa"], "--ruler-tasks 'qa': choose from niah_single"),
    (["--tasks", "ruler", "--ruler-lengths", "100"], "--ruler-lengths at least 256 tokens"),
    (["--tasks", "ruler", "--ruler-samples", "0"], "--ruler-samples must be at least 1"),
])
def test_bad_ruler_arguments_give_one_line_and_exit_2(capsys, model_dir, argv, message):
    assert main(["eval", "--model", str(model_dir), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
