"""Denormal floats are flushed to zero on the calling thread and on every thread of its OpenMP team, also where the
team existed before (kvserve/engine/denormals.py). Run in a fresh interpreter: the mode is per thread and process
state, which the engines built by other tests have set already here."""
import subprocess
import sys
import textwrap

import pytest
import torch

CHECK = textwrap.dedent("""
    import threading
    import torch
    from kvserve.engine.denormals import flush_denormals

    torch.set_num_threads(2)
    tiny = torch.full((1 << 20,), 1e-39)  # float32 denormals; a product over them runs on both threads

    def kept():
        return int((tiny * 1.0).count_nonzero())

    def check(name):
        before = kept()  # the team exists now, made before the mode was set
        line = flush_denormals()
        print(name, before, kept(), line, flush_denormals() == line)

    # a server's engine thread: a team of its own (started before the main thread's mode is set, which a new thread
    # would inherit)
    worker = threading.Thread(target=check, args=("thread",))
    worker.start()
    worker.join()
    check("main")
""")


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="x86's FTZ/DAZ modes")
def test_denormals_are_flushed_on_every_thread_of_the_team():
    lines = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split("\n")
    for name in ("main", "thread"):
        words = next(line for line in lines if line.startswith(name + " ")).split()
        assert words[1] == str(1 << 20) and words[2] == "0", words  # all kept before, none after
        assert " ".join(words[3:]) == "denormal floats flushed to zero on all 2 compute threads True"
