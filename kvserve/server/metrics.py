"""Prometheus metrics named like vLLM's (`vllm:` -> `kvserve:`), in a registry of their own per app.

Engine state (blocks, queue lengths, prefix-cache counters) is read from the engine's latest stats at scrape
time; token counters and latency histograms are fed by `observe`, which the engine thread calls after each step."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from kvserve.outputs import RequestOutput

logger = logging.getLogger("kvserve")

# Scrapers of /metrics share one rendering at most this old (a scrape that comes sooner waits for the next): 64
# clients scraping back to back once kept the event loop busy enough to slow a stream severalfold.
METRICS_MAX_AGE_S = 1.0

# vLLM's buckets, so dashboards built for it read the same
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)

# (metric name, stats key, help) read from engine.stats() at scrape time
GAUGES = [
    ("kvserve:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use (1 = full)."),
    ("kvserve:num_blocks", "num_blocks", "KV cache blocks in the pool."),
    ("kvserve:num_free_blocks", "num_free_blocks", "KV cache blocks not held by any request."),
    ("kvserve:num_used_blocks", "num_used_blocks", "KV cache blocks held by running requests."),
    ("kvserve:num_cached_blocks", "num_cached_blocks", "Blocks whose contents are indexed for prefix reuse."),
    ("kvserve:num_requests_running", "num_running", "Sequences being generated (a request with n=2 counts 2)."),
    ("kvserve:num_requests_waiting", "num_waiting", "Sequences queued for the KV cache, preempted ones included."),
]
COUNTERS = [
    ("kvserve:num_preemptions", "num_preemptions", "Sequences preempted to free KV cache blocks."),
    ("kvserve:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("kvserve:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("kvserve:kv_evicted_blocks", "num_evicted_blocks", "KV blocks dropped by the eviction policy (--kv-eviction)."),
    ("kvserve:kv_window_blocks_freed", "num_window_blocks_freed",
     "KV blocks freed by sliding-window layers once their window passed."),
    ("kvserve:grammars_compiled", "num_grammars_compiled",
     "Structured-output grammars compiled (a spec seen again comes from the cache)."),
    ("kvserve:grammar_compile_seconds", "grammar_compile_seconds", "Time spent compiling structured-output grammars."),
    ("kvserve:constrained_requests", "num_constrained_requests", "Requests with structured outputs or tool calls "
     "constrained by a grammar."),
    ("kvserve:grammar_cache_hits", "num_grammar_cache_hits",
     "Constrained requests whose grammar an earlier request had compiled."),
    ("kvserve:invalid_constrained_outputs", "num_invalid_constrained_outputs",
     "Constrained outputs that stopped where their grammar does not accept (a stop string or token cut them; "
     "else 0)."),
]

# the disk tier's (--kv-disk-cache), when the engine has one
DISK_GAUGES = [
    ("kvserve:kv_disk_cache_blocks", "disk_cache_blocks", "KV blocks of this model and format in the disk tier."),
    ("kvserve:kv_disk_cache_state_checkpoints", "disk_cache_state_checkpoints",
     "Hybrid models' state checkpoints in the disk tier, each beside the block it ends."),
    ("kvserve:kv_disk_cache_bytes", "disk_cache_bytes", "Bytes of records in the disk tier's directory."),
    ("kvserve:kv_disk_cache_capacity_bytes", "disk_cache_capacity_bytes", "The disk tier's cap in bytes."),
    ("kvserve:kv_disk_cache_writing_stopped", "disk_cache_writing_stopped",
     "1 once an I/O error (a full disk) stopped writes to the disk tier."),
]
DISK_COUNTERS = [
    ("kvserve:kv_disk_cache_hit_tokens", "disk_cache_hit_tokens", "Prompt tokens whose KV blocks came from disk."),
    ("kvserve:kv_disk_cache_recomputed_tokens", "disk_cache_recomputed_tokens",
     "Prompt tokens on disk prefilled instead, at the measured rates faster than reading them."),
    ("kvserve:kv_disk_cache_reads", "disk_cache_reads", "Records read from disk and verified: KV blocks, and hybrid models' state checkpoints."),
    ("kvserve:kv_disk_cache_queued_reads", "disk_cache_queued_reads",
     "KV blocks a request found still queued for the disk writer, taken from memory."),
    ("kvserve:kv_disk_cache_read_bytes", "disk_cache_bytes_read", "Bytes read from the disk tier."),
    ("kvserve:kv_disk_cache_read_seconds", "disk_cache_read_seconds", "Time spent reading and verifying blocks."),
    ("kvserve:kv_disk_cache_writes", "disk_cache_writes", "KV blocks written to disk."),
    ("kvserve:kv_disk_cache_written_bytes", "disk_cache_bytes_written", "Bytes written to the disk tier."),
    ("kvserve:kv_disk_cache_writes_skipped", "disk_cache_writes_skipped",
     "KV blocks not written when registered: the writer was behind (handed again later), or a block exceeds the cap."),
    ("kvserve:kv_disk_cache_writes_retried", "disk_cache_writes_retried",
     "Skipped KV blocks handed to the writer again once it had room, from the pool."),
    ("kvserve:kv_disk_cache_evicted", "disk_cache_evicted", "Records removed to hold the cap."),
]
DISK_ERROR_PREFIX = "disk_cache_errors_"

# a hybrid model's state cache (linear-attention layers), when the engine has one
STATE_GAUGES = [
    ("kvserve:num_state_slots", "num_state_slots", "State slots for running sequences (one each, max_num_seqs)."),
    ("kvserve:num_free_state_slots", "num_free_state_slots", "State slots no running sequence holds."),
    ("kvserve:num_state_checkpoint_slots", "num_state_checkpoint_slots",
     "Slots for state checkpoints at block boundaries (prefix caching)."),
    ("kvserve:num_state_checkpoints", "num_state_checkpoints", "State checkpoints held, each a prefix hit may resume."),
]
STATE_COUNTERS = [
    ("kvserve:state_checkpoint_hits", "state_checkpoint_hits",
     "Admissions whose prefix hit resumed from a state checkpoint."),
]

# speculative decoding's (--speculative-config), vLLM's names
SPEC_COUNTERS = [
    ("kvserve:spec_decode_num_drafts", "spec_decode_num_drafts", "Drafts verified (one per drafted sequence and step)."),
    ("kvserve:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    ("kvserve:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Draft tokens accepted (each saves a decode step)."),
]


class _EngineStatsCollector:
    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]], kv_info: dict[str, str]):
        self._model_name = model_name
        self._stats = stats
        self._kv_info = kv_info

    def collect(self):
        info = InfoMetricFamily("kvserve:kv_cache", "How the KV cache stores and keeps tokens.",
                                labels=["model_name"])
        info.add_metric([self._model_name], self._kv_info)
        yield info
        stats = self._stats()
        yield from self._families(stats, GAUGES, COUNTERS)
        if "disk_cache_bytes" in stats:
            yield from self._disk_metrics(stats)
        if "spec_decode_num_drafts" in stats:
            yield from self._spec_metrics(stats)
        if "num_state_slots" in stats:
            yield from self._families(stats, STATE_GAUGES, STATE_COUNTERS)

    def _families(self, stats: dict[str, Any], gauges: list, counters: list):
        """One gauge or counter family per (metric name, stats key, help)."""
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, key, help_text in table:
                family = kind(name, help_text, labels=["model_name"])
                family.add_metric([self._model_name], stats[key])
                yield family

    def _spec_metrics(self, stats: dict[str, Any]):
        yield from self._families(stats, [], SPEC_COUNTERS)
        by_position = CounterMetricFamily("kvserve:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position in the draft (0 first).",
                                          labels=["model_name", "position"])
        for position, value in enumerate(stats["spec_decode_accepted_by_position"]):
            by_position.add_metric([self._model_name, str(position)], value)
        yield by_position

    def _disk_metrics(self, stats: dict[str, Any]):
        yield from self._families(stats, DISK_GAUGES, DISK_COUNTERS)
        errors = CounterMetricFamily("kvserve:kv_disk_cache_errors", "Disk tier records rejected (read as misses) "
                                     "or I/O errors, by kind: corrupt, mismatch, foreign, read, write, not_regular, "
                                     "oversized, unremovable, fd_limit, timeout, unexpected.",
                                     labels=["model_name", "kind"])
        for key, value in stats.items():
            if key.startswith(DISK_ERROR_PREFIX):
                errors.add_metric([self._model_name, key.removeprefix(DISK_ERROR_PREFIX)], value)
        yield errors


@dataclass
class _Progress:
    last_token_s: float
    num_tokens: int = 0  # of its longest sample: one step adds one token to each of a request's n samples
    num_tokens_all: int = 0  # over all n samples


class ServerMetrics:
    """The app's metrics. `observe` runs on the engine thread; `render` on the HTTP loop (prometheus locks)."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, Any]], kv_info: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats, kv_info or {}))
        label = dict(labelnames=["model_name"], registry=self.registry)
        self._prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of started requests.",
                                      **label).labels(model_name)
        self._generation_tokens = Counter("kvserve:generation_tokens", "Tokens generated.", **label).labels(model_name)
        self._ttft = Histogram("kvserve:time_to_first_token_seconds", "Arrival at the engine to first token.",
                               buckets=TTFT_BUCKETS_S, **label).labels(model_name)
        self._itl = Histogram("kvserve:inter_token_latency_seconds", "Time between a request's successive tokens.",
                              buckets=ITL_BUCKETS_S, **label).labels(model_name)
        self._e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival at the engine to finish.",
                              buckets=E2E_BUCKETS_S, **label).labels(model_name)
        self._success = Counter("kvserve:request_success", "Finished requests by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self._seen: dict[str, _Progress] = {}  # by request id, until it finishes

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Count tokens and time them; called with every step's outputs, aborted requests included. An output
        that cannot be counted (a bug) is logged and skipped: metrics never stop the engine thread."""
        for output in outputs:
            try:
                self._observe(output, now)
            except Exception:
                logger.exception(f"metrics: could not count the output of request {output.request_id!r}")
                self._seen.pop(output.request_id, None)

    def _observe(self, output: RequestOutput, now: float) -> None:
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        total = sum(len(c.token_ids) for c in output.outputs)
        progress = self._seen.get(output.request_id)
        if progress is None:
            progress = self._seen[output.request_id] = _Progress(now)
            if longest:  # a request aborted before its first token has no time to first token
                self._prompt_tokens.inc(len(output.prompt_token_ids))
                metrics = output.metrics
                if metrics is not None and metrics.first_token_time is not None:
                    self._ttft.observe(metrics.first_token_time - metrics.arrival_time)
        elif longest > progress.num_tokens:  # one gap per new token (speculative decoding adds several per step)
            gap_s = (now - progress.last_token_s) / (longest - progress.num_tokens)
            for _ in range(longest - progress.num_tokens):
                self._itl.observe(gap_s)
        self._generation_tokens.inc(total - progress.num_tokens_all)
        progress.last_token_s, progress.num_tokens, progress.num_tokens_all = now, longest, total
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        del self._seen[output.request_id]
        reason = output.outputs[0].finish_reason if output.outputs else "abort"
        self._success.labels(self._model_name, reason).inc()
        self._e2e.observe(now - output.metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
