"""llama.cpp (llama-cpp-python on the embedded Q4_1 GGUF) as a baseline, run in a child process so that a crash
in the native library is reported as such instead of taking the benchmark down with it.

llama-cpp-python is the optional `[bench]` extra: it compiles llama.cpp at install time, for minutes.
Child protocol: JSON {"prompts", "output_len", "n_ctx", "n_threads"} on stdin, JSON {"seconds", "outputs"} on stdout."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

NOT_INSTALLED = "not installed (pip install -e '.[bench]')"


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (looked up, not imported: its import loads the native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def generate_sequentially(prompts: list[list[int]], output_len: int, n_ctx: int, n_threads: int) -> dict:
    from llama_cpp import Llama

    from kvserve.model.embedded import embedded_gguf_path

    llama = Llama(str(embedded_gguf_path()), n_ctx=n_ctx, n_threads=n_threads, verbose=False)
    outputs, start = [], time.perf_counter()
    for prompt in prompts:  # its Python API serves one sequence at a time
        tokens = []
        for token in llama.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if len(tokens) == output_len:
                break
        outputs.append(tokens)
    return {"seconds": time.perf_counter() - start, "outputs": outputs}


def run_in_child(prompts: list[list[int]], output_len: int, n_ctx: int, n_threads: int) -> dict:
    """Result dict, or {"error": why} when llama.cpp is missing or its process dies."""
    job = json.dumps({"prompts": prompts, "output_len": output_len, "n_ctx": n_ctx, "n_threads": n_threads})
    proc = subprocess.run([sys.executable, "-m", "kvserve.bench.llama_cpp_baseline"], input=job,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        reason = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        last = proc.stderr.strip().splitlines()[-1:] or [""]
        hint = " (on AMX CPUs: rebuild llama-cpp-python without AMX, see docs/benchmarks.md)" if proc.returncode < 0 else ""
        return {"error": f"llama-cpp-python process failed ({reason}){hint} {last[0]}".strip()}
    return json.loads(proc.stdout)


if __name__ == "__main__":
    args = json.loads(sys.stdin.read())
    print(json.dumps(generate_sequentially(**args)))
