"""Denormal floats are flushed to zero while an engine's step runs, on the calling thread and on every thread of its
OpenMP team, also where the team existed before, and the floating-point environment is as it was afterwards
(kvserve/engine/denormals.py). Run in a fresh interpreter: the mode is per-thread process state."""
import subprocess
import sys
import textwrap

import pytest
import torch

CHECK = textwrap.dedent("""
    import threading
    import torch
    from kvserve.engine import denormals

    torch.set_num_threads(2)
    tiny = torch.full((1 << 20,), 1e-39)  # float32 denormals; a product over them runs on both threads

    def kept():
        python = 5e-324
        return int((tiny * 1.0).count_nonzero()), python * 1.0 != 0.0

    def check(name):
        before = kept()  # the team exists now
        with denormals.flushed_denormals():
            inside = kept()
        print(name, *before, *inside, *kept(), denormals.describe(), sep="|")

    worker = threading.Thread(target=check, args=("thread",))  # a server's engine thread: a team of its own
    worker.start()
    worker.join()
    check("main")
""")


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="x86's FTZ/DAZ modes")
def test_denormals_are_flushed_on_every_thread_of_the_team_while_a_step_runs():
    lines = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split("\n")
    for name in ("main", "thread"):
        fields = next(line for line in lines if line.startswith(name + "|")).split("|")
        everything, python = str(1 << 20), "True"
        assert fields[1:3] == [everything, python], fields  # before: every denormal kept, also Python's
        assert fields[3:5] == ["0", "False"], fields  # inside: none on either thread, nor Python's
        assert fields[5:7] == [everything, python], fields  # after: as before
        assert fields[7] == "denormal floats flushed to zero while steps run, on 2 of 2 compute threads"


def test_an_engine_leaves_the_callers_floats_as_they_were(tmp_path):
    """Building an engine and running its steps changes nothing outside them: the calling thread keeps denormals
    (a property-testing library checks for this, as for -ffast-math)."""
    from kvserve import LLM, SamplingParams
    from tests.conftest import make_tiny_model

    llm = LLM(str(make_tiny_model(tmp_path)), kv_cache_memory="1MiB", max_model_len=64)
    llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    tiny = 5e-324
    assert tiny * 1.0 != 0.0
    assert bool((torch.full((1 << 16,), 1e-39) * 1.0).all())
