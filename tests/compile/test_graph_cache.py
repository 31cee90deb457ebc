"""kvserve/saved_graphs.py and compile/graph_cache.py over an engine's step graphs: what names a saved compiled graph,
a saved graph that cannot be read, the compile times kept beside them."""
from __future__ import annotations

import logging

import torch

from kvserve import inductor_isa, saved_graphs
from kvserve.compile import graph_cache
from kvserve.saved_graphs import GraphKey, describe
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.conftest import make_tiny_model
from tests.compile.test_steps import compare

COMMON = dict(kv_cache_memory="2MiB", max_model_len=512)


def key_of(path, **options) -> str:
    engine = LLM(str(path), **COMMON, enforce_eager=True, **options).engine
    return GraphKey.of(engine.model, engine.cache, {"whole": True}).digest


def test_the_name_holds_the_models_sizes_and_settings_not_its_weights(tmp_path):
    """Weights are a graph's inputs, read at every call: another model of the same sizes and settings names the
    same graphs. Sizes, a setting baked into the code as a constant (the norms' epsilon), the weights' and the
    pool's dtype name others."""
    base = key_of(make_tiny_model(tmp_path / "a"))
    assert key_of(make_tiny_model(tmp_path / "b", seed=1)) == base
    assert key_of(make_tiny_model(tmp_path / "c", rms_norm_eps=1e-5)) != base
    assert key_of(make_tiny_model(tmp_path / "d", intermediate_size=160)) != base
    assert key_of(make_tiny_model(tmp_path / "a"), kv_cache_dtype="bfloat16") != base
    assert key_of(make_tiny_model(tmp_path / "a"), dtype="bfloat16") != base


def test_the_name_holds_torch_python_the_machine_inductors_settings_and_threads(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path)
    base = key_of(path)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "2.99.0")
        assert key_of(path) != base
    with monkeypatch.context() as patch:
        patch.setattr(inductor_isa, "machine_key", lambda: "a CPU with other vector instructions")
        assert key_of(path) != base
    with monkeypatch.context() as patch:
        patch.setattr(saved_graphs, "source_digest", lambda: "kvserve edited")
        assert key_of(path) != base
    with torch._inductor.config.patch(max_autotune=True):
        assert key_of(path) != base
    threads = torch.get_num_threads()
    try:  # Dynamo guards the thread count: another count's graphs would load and then take no call
        torch.set_num_threads(threads + 1)
        assert key_of(path) != base
    finally:
        torch.set_num_threads(threads)
    assert key_of(path) == base


def test_describe_gives_tensors_metadata_not_values_and_objects_by_class():
    a, b = torch.zeros(4, 8), torch.ones(4, 8)
    assert describe(a) == describe(b) == ["tensor", "torch.float32", [4, 8], [8, 1], 0, "cpu", "Tensor"]
    assert describe(a.t()) != describe(a)
    assert describe(object()) == "builtins.object"
    assert describe({"eps": 1e-6, "n": 3, "f": len}) == {"eps": "1e-06", "n": 3, "f": "builtins.len"}


def test_a_saved_graph_that_cannot_be_read_is_compiled_again_and_written_over(tmp_path, caplog):
    path = make_tiny_model(tmp_path)
    first = LLM(str(path), **COMMON, compile_decode=True)
    assert (first.engine.runner.compiled.graphs_loaded, first.engine.runner.compiled.graphs_compiled) == (0, 4)
    files = sorted(saved_graphs.graph_directory().glob("*.bin"))
    assert len(files) == 4
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        second = LLM(str(path), **COMMON, compile_decode=True)
    compiled = second.engine.runner.compiled
    assert (compiled.graphs_loaded, compiled.graphs_compiled) == (3, 1)
    assert caplog.text.count("could not be loaded") == 1
    assert files[0].stat().st_size > 100  # written over
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(7, 20))]
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in first.generate(prompts, params)]
    assert second.engine.runner.num_compiled_steps > 0


def test_a_saved_graph_others_may_write_is_not_loaded(tmp_path, caplog):
    """torch loads a saved graph with pickle: only a file of this user's that no one else may write is loaded."""
    path = make_tiny_model(tmp_path)
    LLM(str(path), **COMMON, compile_decode=True)
    directory = saved_graphs.graph_directory()
    assert directory.stat().st_mode & 0o777 == 0o700
    files = sorted(directory.glob("*.bin"))
    assert [f.stat().st_mode & 0o777 for f in files] == [0o600] * 4
    files[0].chmod(0o620)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        compiled = LLM(str(path), **COMMON, compile_decode=True).engine.runner.compiled
    assert (compiled.graphs_loaded, compiled.graphs_compiled) == (3, 1)
    assert caplog.text.count("may be written by other users; compiling it again") == 1


def test_with_inductors_caches_off_the_graphs_are_traced_and_nothing_is_saved(tmp_path, monkeypatch):
    """TORCHINDUCTOR_FORCE_DISABLE_CACHES (debugging Inductor) makes torch's AOT precompile refuse: the graphs are
    then torch.compile's own, traced at this start, and decode steps still run compiled."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    path = make_tiny_model(tmp_path)
    llm = LLM(str(path), **COMMON, compile_decode=True)
    compiled = llm.engine.runner.compiled
    assert compiled is not None and (compiled.graphs_loaded, compiled.graphs_compiled) == (0, 4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    eager = LLM(str(path), **COMMON, enforce_eager=True)
    for prompts in ([list(range(3, 40))], [list(range(3 + i, 20 + 7 * i)) for i in range(4)]):  # 1, then 4
        compare(eager, llm, prompts, params)  # eager's tokens, logprobs within the compiled step's tolerance
    assert compiled.num_misses == 0
    assert compiled.num_outside_steps > 0
    assert not saved_graphs.graph_directory().exists()


def test_the_family_leaves_kvserves_source_out_and_nothing_else(tmp_path, monkeypatch):
    """GraphKey.family names the same engine on the same machine across kvserve versions: its last compile time
    tells the next start how long compiling will take."""
    engine = LLM(str(make_tiny_model(tmp_path)), **COMMON, enforce_eager=True).engine
    base = GraphKey.of(engine.model, engine.cache, {"whole": True})
    monkeypatch.setattr(saved_graphs, "source_digest", lambda: "another kvserve")
    upgraded = GraphKey.of(engine.model, engine.cache, {"whole": True})
    assert upgraded.digest != base.digest and upgraded.family == base.family
    monkeypatch.setattr(saved_graphs.torch, "__version__", "9.9.9")
    assert GraphKey.of(engine.model, engine.cache, {"whole": True}).family != base.family
    assert GraphKey.of(engine.model, engine.cache, {"whole": False}).family != base.family


def test_compile_times_are_numbers_and_a_bad_file_counts_as_empty(tmp_path, caplog):
    times = graph_cache.CompileTimes(tmp_path / "graphs")
    key = GraphKey(tmp_path, "d" * 40, "f" * 40)
    assert times.last(key) is None  # no file yet
    times.remember(key, 21.44)
    assert times.last(key) == 21.4 and (times.path.stat().st_mode & 0o777) == 0o600
    times.path.write_text('{"' + "f" * 40 + '": "import os", "x": true, "y": -1, "z": 3}')
    assert times.read() == {"z": 3.0}  # only numbers in range; the rest is dropped
    times.path.write_text("{not json")
    assert times.last(key) is None
    times.remember(key, 5.0)  # written over
    assert times.read() == {"f" * 40: 5.0}
    times.path.chmod(0o666)  # others may write it: not read
    assert times.last(key) is None
