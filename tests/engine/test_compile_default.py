"""Compiled decode steps are the default (kvserve/config.py, CompileConfig): an engine asked for nothing compiles its
steps where a graph supports its model and settings, says what it compiles and about how long before it starts, and
runs eagerly, saying why, where none does or the compiler fails; --enforce-eager and --no-compile-decode turn them off.
The suite's own default is eager (tests/conftest.py sets KVSERVE_EAGER_STEPS=1): each test here removes it."""
import logging

import pytest

from kvserve import LLM
from kvserve import saved_graphs
from kvserve.compile import graph_cache
from kvserve.engine.cli import engine_config_from_args
from kvserve.cli import build_parser
from kvserve.sampling_params import SamplingParams
from tests.compile.test_steps import BrokenCompile, compare
from tests.conftest import make_tiny_model
from tests.model.test_qwen3_next import make_hybrid_model

COMMON = dict(kv_cache_memory="2MiB", max_model_len=256)
PROMPTS = [list(range(3, 40)), list(range(7, 20))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture
def user_default(monkeypatch):
    """As a user's process: no KVSERVE_EAGER_STEPS."""
    monkeypatch.delenv("KVSERVE_EAGER_STEPS", raising=False)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_default_engine_compiles_says_so_first_and_a_second_start_loads_the_graphs(tmp_path, caplog, user_default):
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, enforce_eager=True)
    assert eager.engine.runner.compiled is None
    with caplog.at_level(logging.INFO, logger="kvserve"):
        first = LLM(str(path), **COMMON)
    lines = caplog.text.splitlines()
    said = [i for i, line in enumerate(lines) if "decode steps: compiling 4 graphs now (none compiled for this engine "
            "on this machine before" in line]
    done = [i for i, line in enumerate(lines) if "decode steps: compiled (torch.compile; --enforce-eager" in line]
    assert said and done and said[0] < done[0]  # said before the compile, the time it took after
    assert first.engine.runner.compiled is not None and first.engine.runner.compiled.graphs_compiled == 4
    # compiled steps round a few ulps apart from eager: equal tokens, logprobs within the tolerance, a near-tie
    # allowed to go either way (tests/compile/test_steps.py's compare) - not bitwise, which no CPU guarantees
    compare(eager, first, PROMPTS, LOGPROBS)
    # the compile's time is remembered beside the graphs: numbers only, by the engine's family of graphs
    remembered = graph_cache.CompileTimes(saved_graphs.graph_directory()).read()
    assert len(remembered) == 1 and list(remembered.values())[0] > 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve"):
        second = LLM(str(path), **COMMON)
    assert "decode steps: loading 4 saved compiled graphs" in caplog.text
    assert second.engine.runner.compiled.graphs_loaded == 4
    compare(eager, second, PROMPTS, LOGPROBS)


@pytest.mark.parametrize("options, reason", [(dict(enforce_eager=True), "--enforce-eager"),
                                             (dict(compile_decode=False), "--no-compile-decode")])
def test_each_way_out_runs_eagerly_and_says_which(tmp_path, caplog, user_default, options, reason):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(make_tiny_model(tmp_path)), **COMMON, **options)
    assert llm.engine.runner.compiled is None
    assert f"decode steps: eager ({reason})" in caplog.text
    assert not llm.engine.model.linears.dense_in_graph  # no graph would read the dense copies: none kept


def test_the_suites_variable_makes_eager_the_default_and_an_explicit_flag_still_decides(monkeypatch, tmp_path,
                                                                                         caplog):
    monkeypatch.setenv("KVSERVE_EAGER_STEPS", "1")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(make_tiny_model(tmp_path)), **COMMON)
    assert llm.engine.runner.compiled is None
    assert "decode steps: eager (KVSERVE_EAGER_STEPS=1 in the environment)" in caplog.text


@pytest.mark.parametrize("kind, options, reason", [
    ("hybrid", {}, "Qwen3NextModel is not compiled (Llama and Gemma 3 families only)"),
    ("llama", dict(kv_eviction="adakv", kv_sink_tokens=4, kv_recent_tokens=8, kv_budget_tokens=48),
     "kv_eviction='adakv' reads per-head KV streams eagerly"),
    ("llama", dict(batch_invariant=True), "--batch-invariant runs fixed tiles eagerly"),
])
def test_what_no_graph_supports_starts_eager_by_default_with_the_reason(tmp_path, caplog, user_default, kind,
                                                                       options, reason):
    """Where asking for compiled steps is refused (per-head streams) or runs eagerly (hybrids, batch invariance),
    the default starts and runs eagerly, saying why."""
    path = make_hybrid_model(tmp_path, "qwen3_5") if kind == "hybrid" else make_tiny_model(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(path), **COMMON, max_num_seqs=4, **options)
    assert llm.engine.runner.compiled is None
    assert f"decode steps: eager ({reason})" in caplog.text
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)


def test_a_compiler_that_fails_leaves_the_default_engine_eager_and_serving(tmp_path, caplog, monkeypatch,
                                                                          user_default):
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, enforce_eager=True)
    monkeypatch.setattr(graph_cache.torch, "compile", BrokenCompile)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(path), **COMMON)
    assert llm.engine.runner.compiled is None
    assert "compiled decode step failed (RuntimeError: C++ compiler not found); decode steps run eagerly" in \
        caplog.text
    assert tokens(llm) == tokens(eager)


@pytest.mark.parametrize("flags, expected", [([], None), (["--compile-decode"], True),
                                             (["--no-compile-decode"], False)])
def test_the_flags_leave_the_default_to_the_engine(flags, expected):
    def parsed(*argv):
        return engine_config_from_args(build_parser(list(argv)).parse_args(list(argv)))

    assert parsed("generate", "Hello", *flags).compile_decode is expected
    assert not parsed("generate", "Hi", "--enforce-eager").compile.decode_steps
