"""The ingress's /metrics: every replica's own Prometheus metrics under the single server's names, each series with
a `replica` label added, so `sum without (replica) (...)` reads like one big server."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families


class _ReplicaMetrics:
    def __init__(self, texts: dict[str, str]):
        self._texts = texts

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self._texts.items()):
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)
        serving = GaugeMetricFamily("kvserve:num_replicas", "Engine replicas reporting to this endpoint.")
        serving.add_metric([], len(self._texts))
        return [serving, *merged.values()]


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus text exposition of the replicas' metrics texts (replica id -> text)."""
    registry = CollectorRegistry()
    registry.register(_ReplicaMetrics(texts))
    return generate_latest(registry)
