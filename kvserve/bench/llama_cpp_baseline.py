"""llama.cpp (llama-cpp-python on the embedded Q4_1 GGUF) as a baseline, run in a child process so that a crash
in the native library is reported as such instead of taking the benchmark down with it.

Serial: its high-level API, one sequence after another. Batched: its low-level batch API, every request in flight
at once (one llama_decode per step over prompt chunks and one new token per decoding sequence), as kvserve's
continuous batching does, and as llama-server -np N does.

llama-cpp-python is the optional `[bench]` extra: it compiles llama.cpp at install time, for minutes.
Child protocol: JSON {"prompts", "output_len", "n_ctx", "n_threads", "batched"[, "lookup"]} on stdin, JSON {"seconds",
"outputs"} on stdout."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

BATCH_TOKENS = 2048  # tokens per llama_decode call in the batched run (its n_batch)
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (looked up, not imported: its import loads the native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def generate_sequentially(prompts: list[list[int]], output_len: int, n_ctx: int, n_threads: int,
                          lookup: bool = False) -> dict:
    """`lookup`: with llama-cpp-python's prompt lookup decoding (LlamaPromptLookupDecoding, its defaults: 2-grams,
    10 draft tokens), llama.cpp's own speculation without a draft model."""
    from llama_cpp import Llama

    from kvserve.model.embedded import embedded_gguf_path

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding()
    # a draft model needs every position's logits (logits_all), else llama-cpp-python fails to store them
    llama = Llama(str(embedded_gguf_path()), n_ctx=n_ctx, n_threads=n_threads, verbose=False, draft_model=draft,
                  logits_all=lookup)
    outputs, start = [], time.perf_counter()
    for prompt in prompts:  # its Python API serves one sequence at a time
        tokens = []
        for token in llama.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if len(tokens) == output_len:
                break
        outputs.append(tokens)
    return {"seconds": time.perf_counter() - start, "outputs": outputs}


def generate_batched(prompts: list[list[int]], output_len: int, n_ctx: int, n_threads: int) -> dict:
    """Greedy outputs of all prompts decoded together; `n_ctx` is the longest sequence (each gets its own)."""
    import llama_cpp as ll
    import numpy as np

    from kvserve.model.embedded import embedded_gguf_path

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(embedded_gguf_path()).encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_seq_max = len(prompts)
    params.n_ctx = len(prompts) * n_ctx
    params.n_batch = BATCH_TOKENS
    params.n_threads = params.n_threads_batch = n_threads
    ctx = ll.llama_init_from_model(model, params)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(BATCH_TOKENS, 0, 1)
    pending = [list(p) for p in prompts]  # tokens each sequence still has to feed
    positions = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    while any(len(out) < output_len for out in outputs):
        batch.n_tokens, sampled_rows = 0, []
        for seq, tokens in enumerate(pending):
            take = tokens[: BATCH_TOKENS - batch.n_tokens] if len(outputs[seq]) < output_len else []
            for j, token in enumerate(take):
                i = batch.n_tokens
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, positions[seq] + j, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = j == len(tokens) - 1  # logits only where the sequence's next token comes
                batch.n_tokens += 1
            if take and len(take) == len(tokens):
                sampled_rows.append((seq, batch.n_tokens - 1))
            pending[seq], positions[seq] = tokens[len(take) :], positions[seq] + len(take)
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for seq, row in sampled_rows:
            token = int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).argmax())
            outputs[seq].append(token)
            pending[seq] = [token]
    seconds = time.perf_counter() - start
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return {"seconds": seconds, "outputs": outputs}


def run_in_child(prompts: list[list[int]], output_len: int, n_ctx: int, n_threads: int, batched: bool = False,
                 lookup: bool = False) -> dict:
    """Result dict, or {"error": why} when llama.cpp is missing or its process dies."""
    job = json.dumps({"prompts": prompts, "output_len": output_len, "n_ctx": n_ctx, "n_threads": n_threads,
                      "batched": batched, **({"lookup": True} if lookup else {})})
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
    generate = generate_batched if args.pop("batched", False) else generate_sequentially
    print(json.dumps(generate(**args)))
