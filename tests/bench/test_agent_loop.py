"""`kvserve bench agent-loop` (kvserve/bench/agent_loop.py) on a tiny random model with SmolLM2's tokenizer and chat
template: every turn is one valid tool call fed back its result, the shared system prompt and tools are found cached
from the second agent on, and with the disk tier returning agents find more of their history than on the pool alone.
No timings are checked."""

import pytest
from rich.console import Console

from kvserve.bench.agent_loop import AgentWorkload, run_agent_loop
from tests.conftest import make_tiny_chat_model


def test_agents_find_their_history_on_the_disk_tier_after_the_pool_evicted_it(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-chat", max_position_embeddings=4096)
    workload = AgentWorkload(agents=3, turns=3, result_words=60, pool_agents=1.0)
    console = Console(width=120, record=True)
    pool, disk = run_agent_loop(workload, str(model), console)
    assert (pool.name, disk.name) == ("pool only", "disk tier")
    assert all(len(calls) == 3 for calls in pool.calls + disk.calls)
    first = pool.turns[0]
    assert first.cached_tokens[0] == 0 and all(c > 0 for c in first.cached_tokens[1:])  # system prompt and tools
    returning = lambda run: sum(sum(t.cached_tokens) for t in run.turns[1:])  # noqa: E731
    assert returning(disk) > returning(pool) and disk.disk_bytes_read > 0
    assert "Agent loop" in console.export_text()


def test_workload_values_are_checked_naming_the_flag():
    with pytest.raises(ValueError, match="--result-words must be at least 1"):
        AgentWorkload(result_words=0)
    with pytest.raises(ValueError, match="--pool-agents must be positive"):
        AgentWorkload(pool_agents=0)
