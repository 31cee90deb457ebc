"""The endpoint's /metrics: each replica's series under the single server's names, told apart by a replica label,
so summing over replicas gives what one server would count."""
from prometheus_client.parser import text_string_to_metric_families

from kvserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.scaleout.metrics import merge_replica_metrics
from kvserve.server.metrics import ServerMetrics

STATS = {"kv_cache_usage": 0.5, "num_blocks": 8, "num_free_blocks": 4, "num_used_blocks": 4, "num_cached_blocks": 1,
         "num_running": 1, "num_waiting": 0, "num_preemptions": 0, "prefix_cache_queries": 10,
         "prefix_cache_hits": 5, "num_evicted_blocks": 0, "num_window_blocks_freed": 0, "num_grammars_compiled": 0,
         "grammar_compile_seconds": 0.0, "num_constrained_requests": 0, "num_grammar_cache_hits": 0,
         "num_invalid_constrained_outputs": 0}


def replica_text(prompt_tokens: int) -> str:
    """A replica's /metrics after one finished request with a `prompt_tokens`-token prompt."""
    metrics = ServerMetrics("m", lambda: STATS)
    output = RequestOutput("r", None, [7] * prompt_tokens, [CompletionOutput(0, "x", [9], finish_reason="length")],
                           finished=True, metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.5))
    metrics.observe([output], now=2.0)
    return metrics.render().decode()


def samples(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("replica", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if not s.labels.get("le")}


def test_every_replica_series_is_kept_with_its_replica_label():
    merged = samples(merge_replica_metrics({"a": replica_text(3), "b": replica_text(4)}).decode())
    assert merged[("kvserve:prompt_tokens_total", "a")] == 3
    assert merged[("kvserve:prompt_tokens_total", "b")] == 4
    assert merged[("kvserve:prefix_cache_hits_total", "a")] == merged[("kvserve:prefix_cache_hits_total", "b")] == 5
    assert merged[("kvserve:num_replicas", "")] == 2


def test_names_and_types_are_the_single_servers():
    single = {f.name: f.type for f in text_string_to_metric_families(replica_text(1))}
    merged = {f.name: f.type for f in text_string_to_metric_families(
        merge_replica_metrics({"a": replica_text(1)}).decode())}
    assert merged == {**single, "kvserve:num_replicas": "gauge"}


def test_no_replica_reporting_leaves_only_the_count():
    assert samples(merge_replica_metrics({}).decode()) == {("kvserve:num_replicas", ""): 0}
