"""The constrained mix of `kvserve bench throughput --constrained-share` (kvserve/bench/throughput/constrained.py):
which requests are constrained, a schema no request completes before its output length, rounds that alternate which
run goes first, and one round on a tiny random model with SmolLM2's tokenizer, both runs decoding the same number of
tokens. No timings are checked."""

import json
from types import SimpleNamespace

import transformers
from rich.console import Console

from kvserve import LLM
from kvserve.bench.throughput.constrained import ConstrainedMix, constrained_rows, long_schema
from kvserve.bench.throughput.results import RunResult
from kvserve.bench.throughput.runners import _reset, run_kvserve
from kvserve.model.loader import resolve_model
from tests.conftest import make_tiny_chat_model


def test_the_share_is_spread_evenly():
    assert constrained_rows(8, 0.5) == [False, True] * 4
    assert sum(constrained_rows(32, 0.25)) == 8 and not any(constrained_rows(5, 0.0))
    assert all(constrained_rows(3, 1.0))


def test_a_round_runs_both_ways_with_the_same_tokens_and_prints_the_ratio(tmp_path):
    llm = LLM(str(make_tiny_chat_model(tmp_path / "tiny-chat")), kv_cache_memory="64MiB", max_model_len=512)
    prompts = [[100 + i] * (20 + i) for i in range(4)]
    mix = ConstrainedMix(0.5)
    mix.run(llm, prompts, 24, "kvserve", run_kvserve, _reset)
    ((plain, mixed),) = mix.pairs["kvserve"]
    assert [len(t) for t in plain.outputs] == [len(t) for t in mixed.outputs] == [24] * 4
    tokenizer = llm.engine.tokenizer
    for tokens, constrained in zip(mixed.outputs, constrained_rows(4, 0.5)):
        text = tokenizer.decode(tokens)
        assert text.startswith('{"values": [') == constrained, text
    first, cached = mix.compile_s["kvserve"]
    assert first > 0 and cached >= 0 and llm.engine.stats()["num_grammars_compiled"] == 1
    console = Console(width=200, record=True)
    mix.print(console)
    assert "50% of the decode-heavy requests JSON-schema constrained" in console.export_text()


def test_the_shortest_document_is_longer_than_the_output_length():
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)  # the embedded SmolLM2's
    shortest = json.dumps({"values": [0] * 24}, separators=(", ", ": "))
    assert long_schema(24)["properties"]["values"]["minItems"] == 24
    assert len(tokenizer(shortest, add_special_tokens=False).input_ids) > 24


def test_rounds_alternate_which_run_goes_first():
    """Round 0 runs the unconstrained requests first, round 1 the mix first, and so on; each pair stays
    (unconstrained, mixed) whatever the order, and every run starts from a reset engine."""
    calls = []
    llm = SimpleNamespace(engine=SimpleNamespace(grammar=lambda spec: None))

    def run(llm_, prompts, output_len, name, structured=None):
        calls.append(("run", "mix" if structured else "plain"))
        return RunResult(name, 10, 1.0 if structured is None else 2.0)

    mix = ConstrainedMix(0.5)
    for _ in range(3):
        mix.run(llm, [[1, 2]] * 4, 8, "kvserve", run, lambda llm_: calls.append(("reset", None)))
    runs = [what for kind, what in calls if kind == "run"]
    assert runs == ["plain", "mix", "mix", "plain", "plain", "mix"]
    assert [kind for kind, _ in calls] == ["reset", "run"] * 6
    assert all(plain.name == "kvserve" and mixed.name == "kvserve, 50% constrained"
               for plain, mixed in mix.pairs["kvserve"])
