"""The Prometheus metrics read from the engine's stats at scrape time: a hybrid model's state slots and checkpoints
are exported (gauges and a counter, like the disk tier's keys only when present), and nothing of them for a model
without a state cache."""
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.server.metrics import ServerMetrics
from tests.conftest import make_tiny_model
from tests.model.test_qwen3_next import make_hybrid_model, random_prompt

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def scrape(metrics: ServerMetrics) -> dict[str, float]:
    """Each sample's value by its name (the model_name label is the only one these metrics carry)."""
    text = metrics.render().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_state_slots_and_checkpoints_are_exported(tmp_path):
    llm = LLM(str(make_hybrid_model(tmp_path, "qwen3_5")), kv_cache_memory="4MiB", max_model_len=256,
              max_num_seqs=3)
    metrics = ServerMetrics("tiny-hybrid", llm.engine.stats)
    prompt = random_prompt(40, seed=4)
    llm.generate({"prompt_token_ids": prompt}, GREEDY)
    llm.generate({"prompt_token_ids": prompt + random_prompt(20, seed=5)}, GREEDY)  # resumes from a checkpoint
    stats, values = llm.engine.stats(), scrape(metrics)
    assert values["kvserve:num_state_slots"] == 3 and values["kvserve:num_free_state_slots"] == 3
    assert values["kvserve:num_state_checkpoint_slots"] == 3
    assert values["kvserve:num_state_checkpoints"] == stats["num_state_checkpoints"] >= 1
    assert values["kvserve:state_checkpoint_hits_total"] == stats["state_checkpoint_hits"] == 1


def test_a_model_without_a_state_cache_exports_no_state_metrics(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path)), kv_cache_memory="1MiB", max_model_len=128)
    names = scrape(ServerMetrics("tiny", llm.engine.stats))
    assert "kvserve:num_blocks" in names
    assert not [name for name in names if "state" in name]
