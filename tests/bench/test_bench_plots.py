"""`kvserve bench multiturn --plot` and `kvserve bench throughput --plot` on a tiny model: each run writes its
figure, and a bad plot path stops the command before it benchmarks anything."""
import pytest

from kvserve.cli import main
from tests.conftest import image_size, make_tiny_chat_model

MULTITURN = ["bench", "multiturn", "--turns", "3", "--first", "20", "--question", "5", "--answer", "3",
             "--max-model-len", "256", "--kv-cache-memory", "1MiB"]
THROUGHPUT = ["bench", "throughput", "--num-requests", "2", "--min-prompt-len", "4", "--max-prompt-len", "8",
              "--output-len", "2", "--dtypes", "float32", "--skip", "transformers", "llama.cpp",
              "--kv-cache-memory", "1MiB"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("bench") / "tiny-chat")


@pytest.mark.parametrize("argv, width_px", [(MULTITURN, 8 * 120), (THROUGHPUT, 9 * 120)])
def test_plot_is_written(model_dir, tmp_path, capsys, argv, width_px):
    out = tmp_path / "figure.png"
    assert main([*argv, "--model", str(model_dir), "--plot", str(out)]) == 0
    assert f"plot written to {out}" in capsys.readouterr().out
    kind, width, height = image_size(out)
    assert kind == "png" and width == width_px and height > 200 and out.stat().st_size > 10_000


@pytest.mark.parametrize("argv", [MULTITURN, THROUGHPUT])
def test_a_bad_plot_path_fails_before_the_benchmark(tmp_path, argv):
    # the model does not exist either: the plot path is checked before anything is loaded
    with pytest.raises(SystemExit, match=r"--plot .*plot\.jpg: the name must end in \.png or \.svg"):
        main([*argv, "--model", str(tmp_path / "no-model"), "--plot", str(tmp_path / "plot.jpg")])
