"""Every figure writes a real image in the format its file name asks for, at the size it is drawn; a bad path is
refused before anything is drawn, with an error that names it."""
import pytest

from kvserve.plots import (check_plot_path, plot_multiturn, plot_plan, plot_quality_vs_bytes, plot_throughput,
                           plot_tiers)
from tests.conftest import image_size

CURVES = {"bf16, 128 KiB/token": [(256, 160.0), (8192, 5.0), (131072, 0.3)], "fp8": [(256, 320.0), (131072, 0.6)]}
SPLIT = [("weights", 15 * 2**30), ("other", 3 * 2**29), ("KV cache", 5 * 2**30), ("unused", 2 * 2**30)]


@pytest.mark.parametrize("draw, size_in", [
    (lambda path: plot_plan(path, "a GPU", SPLIT, CURVES, 131072), (11, 4.2)),
    (lambda path: plot_plan(path, "weights too big", SPLIT[:1], {}, 8192), (11, 4.2)),
    (lambda path: plot_multiturn(path, [40, 56, 72], [40, 24, 24], [40, 56, 72]), (8, 4.2)),
    (lambda path: plot_tiers(path, "tiers", {"pool only": [(216, 0.5), (216, 0.7), (432, 0.9)],
                                             "disk tier": [(216, 0.2)]}, {"pool only": 1200, "disk tier": 420}, 400),
     (11, 4.2)),
    (lambda path: plot_throughput(path, {"kvserve (float32)": 61.0, "transformers": 48.0}, {}), (9, 1.2 + 0.84)),
    (lambda path: plot_quality_vs_bytes(path, "SmolLM2", {"Δppl (%)": [("bf16", 4096, 0.0), ("int4", 1152, 0.7)],
                                                           "KLD": [("bf16", 4096, 0.0), ("int4", 1152, 0.01)]}),
     (11, 4.2)),
])
@pytest.mark.parametrize("suffix", [".png", ".svg", ".PNG"])
def test_each_figure_writes_the_format_its_name_asks_for(tmp_path, draw, size_in, suffix):
    path = tmp_path / f"figure{suffix}"
    assert draw(path) == path
    kind, width, height = image_size(path)
    assert kind == suffix[1:].lower() and path.stat().st_size > 5_000
    unit = 120 if kind == "png" else 72  # pixels at the figures' 120 dpi; SVG sizes are in points
    assert (width, height) == pytest.approx((size_in[0] * unit, size_in[1] * unit), abs=1)


@pytest.mark.parametrize("name, words", [
    ("plot.jpg", "must end in .png or .svg"),
    ("plot", "must end in .png or .svg"),
    ("missing/plot.png", "the directory"),
])
def test_a_bad_path_is_refused_naming_it(tmp_path, name, words):
    with pytest.raises(ValueError, match=words) as error:
        check_plot_path(tmp_path / name)
    assert str(tmp_path / name) in str(error.value)


def test_a_directory_is_not_a_file_name(tmp_path):
    (tmp_path / "out.png").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        plot_multiturn(tmp_path / "out.png", [1], [1], [1])
