"""`kvserve bench startup`: each cached compiled start is compared with the eager start right beside it, every
quantization starts from a compile cache of its own, and a real start of a tiny model is timed and read."""
import re
from pathlib import Path

import pytest

from kvserve.bench import startup
from kvserve.cli import main
from tests.conftest import make_tiny_model, save_char_tokenizer


def test_cached_starts_are_paired_with_the_eager_start_beside_them(monkeypatch, capsys):
    # launch-to-exit seconds of a fake start, in the order run: the machine slows down in the second pair, which
    # a difference of medians (15 - 11.5 = 3.5 s) would not see; each pair says +3 s
    seconds = {"eager": iter([10.0, 12.0, 30.0, 11.0] * 2), "compiled": iter([40.0, 15.0, 33.0, 14.0] * 2)}
    calls = []

    def fake_start(command, cache_dir):
        compiled = "--enforce-eager" not in command
        calls.append((command, cache_dir))
        assert Path(cache_dir).is_dir()
        return startup.Start(next(seconds["compiled" if compiled else "eager"]), 2.5 if compiled else None,
                             "Dynamo's tracing 1.5 s, Inductor 0.5 s" if compiled else "")

    monkeypatch.setattr(startup, "run_start", fake_start)

    assert main(["bench", "startup", "--rounds", "3"]) == 0

    kinds = ["eager" if "--enforce-eager" in command else "compiled" for command, _ in calls]
    assert kinds == ["eager", "compiled"] * 4 * 2  # eager, first, then 3 pairs; for none and for int8
    dirs = [d for _, d in calls]
    assert len(set(dirs[:8])) == 1 and len(set(dirs[8:])) == 1 and dirs[0] != dirs[8]  # a cache per quantization
    assert not Path(dirs[0]).exists()  # removed after
    assert [c[c.index("--quantization") + 1] for c, _ in calls] == ["none"] * 8 + ["int8"] * 8
    out = capsys.readouterr().out
    assert "+30.0 s over the eager start before it" in out  # 40 - 10
    assert re.search(r"cached compiled start: 15\.0 s, \+3\.0 s over the eager start beside it \(each pair: "
                     r"\+3\.0, \+3\.0, \+3\.0; compile 2\.5 s, the last: Dynamo's tracing 1\.5 s, Inductor 0\.5 s\); "
                     r"goal at most \+3 s: met", out)


def test_a_start_that_falls_back_to_eager_is_named(monkeypatch):
    monkeypatch.setattr(startup, "run_start", lambda command, cache_dir: startup.Start(5.0, None))
    with pytest.raises(SystemExit, match="--quantization none: the default start compiled no decode graph"):
        main(["bench", "startup", "--quantization", "none", "--rounds", "1"])


def test_a_start_that_fails_is_named_with_its_error(tmp_path):
    with pytest.raises(SystemExit, match=f"exited with 1: .*{tmp_path / 'absent'} does not exist"):
        main(["bench", "startup", "--model", str(tmp_path / "absent"), "--quantization", "none", "--rounds", "1"])


# `kvserve ARGS` with the float matmul pinned: its start-up probe times two routes, and on a loaded machine two
# starts of the tiny model may pick different ones, each a graph of its own (named apart: kvserve/saved_graphs.py)
PINNED_KVSERVE = ("import sys; from kvserve.model import float_kernels, linear; "
                  "linear.choose_matmul = lambda dtype, shapes=None: float_kernels.BLAS; "
                  "from kvserve.cli import main; sys.exit(main(sys.argv[1:]))")


def pinned_start(model, compiled: bool) -> list[str]:
    command = startup.start_command(str(model), "none", compiled)
    assert command[1:3] == ["-m", "kvserve"]
    return [command[0], "-c", PINNED_KVSERVE, *command[3:]]


@pytest.mark.slow
def test_a_real_start_is_timed_and_its_compile_read(tmp_path):
    model = save_char_tokenizer(make_tiny_model(tmp_path))
    cache = tmp_path / "inductor"
    eager = startup.run_start(pinned_start(model, compiled=False), str(cache))
    first = startup.run_start(pinned_start(model, compiled=True), str(cache))
    cached = startup.run_start(pinned_start(model, compiled=True), str(cache))
    assert eager.compile_seconds is None and eager.seconds > 0
    assert first.compile_seconds is not None and cached.compile_seconds is not None
    # the start-up line says how the start got its graphs and where a compile went (torch.compile's own timers):
    # the first start compiles and saves them, a cached start loads them and traces nothing
    tracing = re.search(r"Dynamo's tracing ([\d.]+) s", first.phases)
    assert tracing and float(tracing.group(1)) <= first.compile_seconds and "Inductor" in first.phases
    assert first.phases.startswith("4 graphs compiled") and "loaded" not in first.phases
    assert cached.phases.startswith("4 graphs loaded from ") and "compiled" not in cached.phases
    assert "Dynamo's tracing" not in cached.phases
    with pytest.raises(RuntimeError, match="exited with 2"):
        startup.run_start([*startup.start_command(str(model), "none", compiled=False), "--no-such-flag"], str(cache))
