"""`kvserve bench throughput` without llama-cpp-python (the `[bench]` extra): it says so and runs the rest; one
row per kvserve configuration (dtype x weights x KV format), a roofline line, and bad values named."""
import re

import pytest

from kvserve.bench import llama_cpp_baseline
from kvserve.bench.throughput import runners, workloads
from kvserve.bench.throughput.results import RunResult
from kvserve.model import float_kernels, linear
from kvserve.cli import main
from tests.conftest import make_tiny_model

TINY_RUN = ["bench", "throughput", "--num-requests", "2", "--min-prompt-len", "8", "--max-prompt-len", "8",
            "--output-len", "2", "--dtypes", "float32", "--workloads", "decode", "--skip", "transformers", "single"]


@pytest.mark.slow
def test_missing_llama_cpp_is_named_with_its_install_command(monkeypatch, capsys):
    monkeypatch.setattr(llama_cpp_baseline, "llama_cpp_installed", lambda: False)

    assert main(TINY_RUN) == 0

    out = capsys.readouterr().out
    assert "llama.cpp: not installed (pip install -e '.[bench]')" in out
    assert "kvserve (float32)" in out  # the table still comes, with kvserve's row
    assert "did not run" not in out and "llama-cpp-python process failed" not in out


@pytest.mark.slow
def test_one_row_per_configuration_and_a_roofline(capsys):
    argv = [*TINY_RUN, "llama.cpp", "--quantization", "none,int8", "--kv-cache-dtype", "auto", "int8"]

    assert main(argv) == 0

    out = capsys.readouterr().out
    for name in ("kvserve (float32)", "kvserve (float32, KV int8)", "kvserve (float32, int8 weights)",
                 "kvserve (float32, int8 weights, KV int8)"):
        assert f"│ {name} " in out
    assert "roofline: this workload's matmuls" in out and "kvserve (float32, int8 weights): " in out
    assert "÷ kvserve (float32)" in out and "decode tokens/s" in out
    # each row's two ceilings: decode steps at their matmuls and one K/V read, prompt steps too or as they ran
    ceilings = re.findall(r"\(ceiling \d+%: [\d.,]+ GB of K/V; \d+% with its steps with prompt tokens as they ran, "
                          r"[\d.]+ s\)", out)
    assert len(ceilings) == 4


@pytest.mark.slow
def test_compiled_and_eager_decode_rows_in_one_run(capsys, tmp_path):
    # a tiny random model: compiling the embedded model's 30 layers takes minutes on 2 cores
    argv = [*TINY_RUN, "llama.cpp", "roofline", "--compile-decode", "off", "on", "--model",
            str(make_tiny_model(tmp_path))]

    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "│ kvserve (float32) " in out and "│ kvserve (float32, compiled decode) " in out
    # the two 8-token prompts decode side by side: every step runs a graph, their prompts' step too, and it is said
    ran = re.findall(r"compiled decode\): compiled graphs ran (\d+) of its (\d+) decode-only steps and (\d+) of "
                     r"its (\d+) steps with prompt tokens", out)
    assert len(ran) == 1 and int(ran[0][0]) == int(ran[0][1]) > 0 and int(ran[0][2]) == int(ran[0][3]) > 0


@pytest.mark.slow
def test_a_row_per_block_size_each_engine_built_with_its_own(monkeypatch, capsys):
    from kvserve.engine import llm as llm_module

    built = []  # the block size of every engine the benchmark builds

    class RecordingLLM(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.engine.config.block_size)

    monkeypatch.setattr(llm_module, "LLM", RecordingLLM)
    argv = [*TINY_RUN, "llama.cpp", "roofline", "--block-size", "16", "8", "8"]

    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "│ kvserve (float32) " in out and "│ kvserve (float32, blocks of 8) " in out  # a repeated value runs once
    assert built == [16, 8]


def test_a_row_per_eviction_policy_each_engine_built_with_it(monkeypatch, capsys):
    from kvserve.engine import llm as llm_module

    built = []  # the eviction of every engine the benchmark builds

    class RecordingLLM(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            config = self.engine.config
            built.append((config.kv_eviction, config.kv_budget_tokens, config.kv_recent_tokens))

    monkeypatch.setattr(llm_module, "LLM", RecordingLLM)
    argv = [*TINY_RUN, "llama.cpp", "roofline", "--min-prompt-len", "64", "--max-prompt-len", "64",
            "--kv-eviction", "none,perhead-span", "--kv-budget-tokens", "40", "--kv-recent-tokens", "4"]

    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "│ kvserve (float32" in out and "perhead-span budget 40" in out.replace("\n│", "")
    assert built[0][0] == "none" and built[1] == ("perhead-span", 40, 4)


@pytest.mark.slow
def test_repeated_runs_interleave_and_report_each_rounds_ratio(capsys):
    argv = [*TINY_RUN, "llama.cpp", "roofline", "--kv-cache-dtype", "auto,int4", "--repeat", "3"]

    assert main(argv) == 0

    out = capsys.readouterr().out
    assert out.count("│ kvserve (float32) ") == 1 and out.count("│ kvserve (float32, KV int4) ") == 1  # medians
    line = next(x for x in out.splitlines() if x.strip().startswith("kvserve (float32, KV int4):"))
    assert line.count("x") == 4  # three rounds' ratios and their median
    assert "median of 3 interleaved runs" in out


@pytest.mark.slow
def test_every_timed_run_computes_its_prompts_in_full(monkeypatch):
    # the warm-up run and the batched run leave prompts in the prefix cache; the other engines get no such head
    # start, so each timed kvserve run must start with it empty
    runs = []  # (prompt tokens given, the run's result)
    run_kvserve = runners.run_kvserve

    def recorded(llm, prompts, *args):
        runs.append((sum(map(len, prompts)), run_kvserve(llm, prompts, *args)))
        return runs[-1][1]

    monkeypatch.setattr(runners, "run_kvserve", recorded)
    argv = [*TINY_RUN, "llama.cpp", "roofline", "--min-prompt-len", "40", "--max-prompt-len", "40"]
    argv.remove("single")

    assert main(argv) == 0

    assert len(runs) == 3  # warm-up, batched, single stream
    assert [result.prefill_tokens for _, result in runs] == [prompt_tokens for prompt_tokens, _ in runs]


@pytest.mark.parametrize("option, value, message", [
    ("--repeat", "0", "--repeat must be at least 1, got 0"),
    ("--quantization", "int4", "quantization='int4' is not supported; choose one of none, int8"),
    ("--kv-cache-dtype", "int3", "kv_cache_dtype='int3' is not supported"),
    ("--workloads", "chat", "unknown workload 'chat'; choose from decode, prefill, long-context, rewrite"),
    ("--speculative", "eagle", "--speculative takes off, ngram, suffix"),
    ("--num-speculative-tokens", "0", "num_speculative_tokens must be a positive integer"),
    ("--compile-decode", "maybe", "--compile-decode takes default, off, on and/or gemms, got ['maybe']"),
    ("--block-size", "0", "block_size must be a positive integer, got 0"),
    ("--kv-eviction", "lru", "kv_eviction='lru' is not supported"),
])
def test_bad_values_are_named_before_anything_loads(option, value, message):
    argv = ["bench", "throughput", option, value]
    if option == "--num-speculative-tokens":
        argv += ["--speculative", "ngram"]
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(argv)


@pytest.mark.slow
def test_speculation_rows_say_how_much_was_accepted(monkeypatch, capsys):
    from kvserve.bench.rewrite import RewriteWorkload

    monkeypatch.setattr(workloads, "RewriteWorkload", lambda: RewriteWorkload(2, 60, 90, 24))
    argv = ["bench", "throughput", "--workloads", "rewrite", "--dtypes", "float32", "--skip", "transformers",
            "llama.cpp", "roofline", "--speculative", "off", "ngram"]

    assert main(argv) == 0

    out = capsys.readouterr().out
    assert "│ kvserve (float32, ngram k=4) " in out and "Single stream (2 prompts of" in out
    text = " ".join(out.split())  # rich wraps long lines where it likes
    line = text[text.index("kvserve (float32, ngram k=4): ") :]
    assert "draft tokens accepted" in line.split("requests")[0]
    assert "identical to kvserve (float32) for 100% of requests" in line


@pytest.mark.slow
def test_decode_time_per_token_is_split_into_matmuls_and_the_rest(capsys, monkeypatch):
    # F.linear's weights, which the split replays (oneDNN's packed ones are not split: the test above)
    monkeypatch.setattr(float_kernels, "choose_matmul", lambda dtype, shapes=None: float_kernels.BLAS)
    monkeypatch.setattr(linear, "choose_matmul", lambda dtype, shapes=None: float_kernels.BLAS)
    argv = [*TINY_RUN, "llama.cpp", "--output-len", "4"]
    argv.remove("single")

    assert main(argv) == 0

    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines where it likes
    assert out.count("decode steps, per token: their matmuls alone") == 2  # the batched run and the single stream
    splits = re.findall(r"kvserve \(float32\): ([\d.]+) ms = matmuls ([\d.]+) \+ the rest (-?[\d.]+)", out)
    assert len(splits) == 2
    for total, matmuls, rest in splits:
        assert float(matmuls) > 0 and abs(float(total) - float(matmuls) - float(rest)) < 0.11
    least = re.findall(r"\(attention, norms, RoPE, Python\); least ([\d.]+) ms with its K/V read once "
                       r"\(([\d.]+) ms\)", out)
    assert out.count("a token: the floor under any matmul kernel") == 2
    assert len(least) == 2  # a tiny model's K/V is a few KiB a token: its time prints as 0.0 ms
    assert all(abs(float(bound) - float(matmuls) - float(kv)) < 0.11 for (bound, kv), (_, matmuls, _) in
               zip(least, splits))


@pytest.mark.slow
def test_llama_cpps_single_stream_runs_right_after_each_of_kvserves(monkeypatch, capsys):
    """This machine's speed drifts over tens of seconds, so each kvserve single stream is compared with a llama.cpp
    run made right after it, run by run; llama.cpp's row is the median of those runs."""
    # llama.cpp's tokens/s, run by run (a fake llama.cpp), far enough apart that the machine's noise on kvserve's
    # own runs cannot hide which llama.cpp run each kvserve run was divided by
    events, speeds = [], iter([1.0, 100.0, 10.0])
    serial = runners.run_kvserve_serial

    def kvserve_single(*args):
        events.append("kvserve")
        return serial(*args)

    def llama_cpp(prompts, output_len, n_ctx, name, batched=False, lookup=False):
        events.append(name)
        tokens = len(prompts) * output_len
        seconds = tokens / next(speeds) if name == "llama.cpp" else 1.0
        return RunResult(name, tokens, seconds)

    monkeypatch.setattr(runners, "llama_cpp_ready", lambda console: True)
    monkeypatch.setattr(runners, "run_llama_cpp", llama_cpp)
    monkeypatch.setattr(runners, "run_kvserve_serial", kvserve_single)
    argv = [*TINY_RUN, "roofline", "--repeat", "3"]
    argv.remove("single")

    assert main(argv) == 0

    singles = [e for e in events if e in ("kvserve", "llama.cpp")]
    assert singles == ["kvserve", "llama.cpp"] * 3
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("│ llama.cpp (median of 3 runs) "))
    assert row.split("│")[4].strip() == "10.0"  # tokens/s: the median of 1, 100 and 10
    line = next(x for x in out.splitlines() if x.strip().startswith("kvserve (float32):") and "x (" in x)
    ratios = [float(x) for x in re.findall(r"([\d.]+)x", line)]
    assert len(ratios) == 4  # three runs, each over its own llama.cpp run, and their median
    assert ratios[0] > 10 * ratios[1] and ratios[2] > 2 * ratios[1]  # over 1, 100 and 10 tokens/s: 100x and 10x
    assert "single stream ÷ llama.cpp run right after it" in out


@pytest.mark.slow
def test_transformers_runs_at_the_end_of_each_round_and_each_round_is_divided_by_its_own(monkeypatch, capsys):
    """With --repeat, transformers' batched run comes after each round's kvserve runs (not once after all rounds),
    its row is the median of those runs, and each kvserve run is divided by the transformers run of its round."""
    events, speeds = [], iter([1.0, 100.0, 10.0])  # transformers' tokens/s, round by round (a fake transformers)
    kvserve_batched = runners.run_kvserve

    def kvserve(*args, **kwargs):
        events.append("kvserve")
        return kvserve_batched(*args, **kwargs)

    def transformers(model, prompts, output_len, batch_size, pad_id, use_cache=True, name="transformers",
                     phases=False):
        timed = batch_size == 16  # the --hf-batch-size default; the warm-up runs batches of 2
        events.append(name if timed else "warm-up")
        tokens = len(prompts) * output_len
        return RunResult(name, tokens, tokens / next(speeds) if timed else 1.0,
                                    [[0] * output_len for _ in prompts])

    monkeypatch.setattr(runners, "load_transformers", lambda path, dtype: object())
    monkeypatch.setattr(runners, "run_transformers", transformers)
    monkeypatch.setattr(runners, "run_kvserve", kvserve)
    argv = [*TINY_RUN, "llama.cpp", "roofline", "--repeat", "3"]
    argv.remove("transformers")

    assert main(argv) == 0

    # each round: kvserve's warm-up and timed run, then transformers (its warm-up once, after the first round)
    assert events == ["kvserve", "kvserve", "warm-up", "transformers"] + ["kvserve", "kvserve", "transformers"] * 2
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("│ transformers "))
    assert row.split("│")[4].strip() == "10.0"  # tokens/s: the median of 1, 100 and 10
    assert "transformers: median of 3 runs, one at the end of each round" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("kvserve (float32):") and "x (" in x)
    ratios = [float(x) for x in re.findall(r"([\d.]+)x", line)]
    assert len(ratios) == 4 and ratios[0] > 10 * ratios[1] and ratios[2] > 2 * ratios[1]


def test_transformers_runs_the_dtype_asked_for(monkeypatch, capsys, tmp_path):
    """--hf-dtype: the baseline's weights in bfloat16 where its torch fallback is faster that way (hybrids)."""
    loaded = []
    real = runners.load_transformers
    monkeypatch.setattr(runners, "load_transformers", lambda path, dtype: loaded.append(dtype) or real(path, dtype))
    argv = [*TINY_RUN[:-2], "llama.cpp", "single", "roofline", "--hf-dtype", "bfloat16", "--hf-batch-size", "2",
            "--model", str(make_tiny_model(tmp_path))]
    assert main(argv) == 0
    import torch

    assert loaded == [torch.bfloat16]
    out = capsys.readouterr().out
    assert "transformers: bfloat16 weights (--hf-dtype)" in out and "transformers: bfloat16, generate()" in out


def test_a_default_rows_name_says_what_its_engine_ran():
    """--compile-decode default: named by whether the engine compiled (a hybrid model runs eagerly); an explicit
    mode keeps its own name."""
    from kvserve.bench.throughput.configs import KvserveConfig

    default = KvserveConfig("float32", "none", "auto")
    assert default.ran_as(True) == "kvserve (float32, compiled decode)" and default.ran_as(False) == "kvserve (float32)"
    asked = KvserveConfig("float32", "none", "auto", compile_decode=True)
    assert asked.ran_as(False) == "kvserve (float32, compiled decode)"
    # a hybrid model's engine: eager steps, its states' decode update compiled (kv/state_cache.py)
    hybrid = "kvserve (bfloat16, compiled state update)"
    for config in (KvserveConfig("bfloat16", "none", "auto"),
                   KvserveConfig("bfloat16", "none", "auto", compile_decode=True)):
        assert config.ran_as(False, state_update_compiled=True) == hybrid
