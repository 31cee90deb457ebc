"""`kvserve bench throughput`: the same synthetic requests through kvserve, transformers and llama.cpp, in one run.

Workloads (fixed seed, greedy, EOS ignored everywhere, so every engine produces exactly the same number of tokens):
decode-heavy (N requests, prompt lengths uniform in [min, max], long outputs: the --num-requests ... options),
prefill-heavy (12 prompts of 50-400 tokens, 48 new tokens each) and long-context (16 requests of 4,096-token
prompts, 32 new tokens each: decode reads a lot of KV per token). kvserve runs once per configuration
(--dtypes x --quantization x --kv-cache-dtype), taking all requests at once (continuous batching);
transformers runs padded static batches through `generate`; llama.cpp (llama-cpp-python on the Q4_1 GGUF) runs
them one after another and, through its batch API, all at once. Single stream: one request, tokens/s.
With --repeat N the kvserve configurations run round after round, transformers' batched runs at the end of each
round and llama.cpp's single stream right after each of kvserve's: every ratio is also given run by run against
the baseline run beside it (the machine's speed drifts over minutes).
A roofline line per workload compares each kvserve run's matmul FLOP/s with float32 matmuls of the same shapes
replayed in the same run, multiplied as the engine multiplies float32 (kvserve/bench/roofline.py).

cli.py parses and runs the command, configs.py and workloads.py say what is run, runners.py runs and times each
engine, results.py holds what a run produced and report.py prints it."""
