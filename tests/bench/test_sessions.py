"""`kvserve bench serve --conversations`: every conversation runs to its last turn, each turn sending the whole
history, and on a single server (one cache for everyone) every turn after the first finds its history cached."""
import asyncio
import dataclasses
import json

import pytest

from kvserve import EngineConfig, LLMEngine
from kvserve.bench.routing import RouterRun, big_replica, cached_share_ratios, router_setups, write_turns
from kvserve.bench.sessions import SessionsConfig, SessionsReport, TurnResult, run_sessions
from kvserve.scaleout.config import ScaleOutConfig
from kvserve.server.app import build_app
from kvserve.server.launch import ServerThread
from tests.conftest import make_tiny_chat_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = make_tiny_chat_model(tmp_path_factory.mktemp("sessions") / "tiny-chat")
    engine = LLMEngine(EngineConfig(model=str(directory), kv_cache_memory="64MiB", max_model_len=1024))
    with ServerThread(build_app(engine)) as server:
        yield server


def test_every_turn_after_the_first_finds_its_history_cached(server):
    config = SessionsConfig(base_url=server.url, conversations=3, turns=4, first_len=60, question_len=20,
                            answer_len=8, seed=1)
    report = asyncio.run(run_sessions(config))
    assert len(report.succeeded) == len(report.turns) == 12
    by_conversation = {c: [t for t in report.turns if t.conversation == c] for c in range(3)}
    for turns in by_conversation.values():
        assert [t.turn for t in turns] == [1, 2, 3, 4]
        assert all(t.output_tokens == 8 and t.ttft_s > 0 for t in turns)
        assert all(later.prompt_tokens > earlier.prompt_tokens + 20 for earlier, later in zip(turns, turns[1:]))
        assert all(later.cached_tokens >= earlier.prompt_tokens - 32 for earlier, later in zip(turns, turns[1:]))
    assert report.prefilled_tokens == report.prompt_tokens - report.cached_tokens
    assert 0.5 < report.cached_share < 1


def test_conversations_differ_and_repeat_with_the_seed():
    config = SessionsConfig(conversations=2, turns=3, first_len=10, question_len=5)
    assert config.messages(0) == config.messages(0) != config.messages(1)
    assert [len(m.split()) for m in config.messages(0)] == [10, 5, 5]


def test_bad_sessions_config_is_refused():
    with pytest.raises(ValueError, match="turns must be at least 1"):
        SessionsConfig(turns=0)


def test_one_big_replica_holds_every_replicas_cpus_and_cache():
    scale = ScaleOutConfig(engine=EngineConfig(kv_cache_memory="1MiB"), replicas=3, replica_cpus=2)
    big = big_replica(scale)
    assert (big.replicas, big.replica_cpus, big.engine.kv_cache_memory) == (1, 6, 3 << 20)


def report_with_share(cached: int) -> SessionsReport:
    return SessionsReport(SessionsConfig(), 1.0, [TurnResult(0, 1, True, prompt_tokens=100, cached_tokens=cached)])


def test_prefix_routing_is_compared_with_one_big_replica_and_the_baselines():
    runs = [RouterRun("one big replica", 1, report_with_share(80)), RouterRun("prefix", 2, report_with_share(76)),
            RouterRun("round-robin", 2, report_with_share(19))]
    assert cached_share_ratios(runs) == ["prefix routing's cached share is 0.95x one big replica's",
                             "prefix routing's cached share is 4.00x round-robin's"]


def test_with_a_disk_tier_each_router_runs_again_with_its_replicas_sharing_one(tmp_path):
    scale = ScaleOutConfig(engine=EngineConfig(kv_cache_memory="1MiB", kv_disk_cache=str(tmp_path)), replicas=2)
    setups = router_setups(scale, ["prefix", "round-robin"])
    assert [(name, setup.router, shares) for name, setup, shares in setups] == [
        ("one big replica", "round-robin", False), ("prefix", "prefix", False), ("round-robin", "round-robin", False),
        ("prefix + shared disk tier", "prefix", True), ("round-robin + shared disk tier", "round-robin", True)]
    assert [setup.engine.kv_disk_cache for _, setup, _ in setups] == [None] * 3 + [str(tmp_path)] * 2
    assert [name for name, _, _ in router_setups(dataclasses.replace(scale, engine=EngineConfig()), ["pow2"])] == \
        ["one big replica", "pow2"]
    runs = [RouterRun("round-robin", 2, report_with_share(40)),
            RouterRun("round-robin + shared disk tier", 2, report_with_share(76))]
    assert cached_share_ratios(runs) == ["round-robin + shared disk tier: cached share 1.90x round-robin's alone"]


def test_turns_are_written_as_json_lines_with_their_replica(tmp_path):
    report = SessionsReport(SessionsConfig(), 1.0, [TurnResult(0, 1, True, 100, 16, replica="r1"),
                                                   TurnResult(0, 2, True, 150, 96, replica="r2")])
    write_turns(str(tmp_path / "turns.jsonl"), [RouterRun("prefix", 2, report)])
    rows = [json.loads(line) for line in (tmp_path / "turns.jsonl").read_text().splitlines()]
    assert [(r["setup"], r["turn"], r["replica"], r["cached_tokens"]) for r in rows] == \
        [("prefix", 1, "r1", 16), ("prefix", 2, "r2", 96)]
