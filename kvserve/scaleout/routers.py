"""kvserve's request routers, plugged into Ray Serve's RequestRouter extension point (alpha API): Serve builds one
per deployment handle, in the ingress process, and asks it which replica takes each request.

- prefix: the replica holding the longest run of the request's leading blocks (on a tie, the one whose cache is
  least pressed by its live conversations), unless load is too uneven;
- pow2: power of two choices (two random replicas, the less loaded wins), Serve's own default policy;
- round-robin: replicas in turn, blind to load and cache (the baseline prefix routing must beat)."""
from __future__ import annotations

import itertools
import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.scaleout.config import DEFAULT_IMBALANCE_THRESHOLD
from kvserve.scaleout.prefix_index import PrefixIndex, rank_replicas


class _RankingRouter(RequestRouter):
    def _ranked(self, pending_request: PendingRequest | None, ranks: list[list[RunningReplica]]):
        # Every candidate is in `ranks`: when all are full, Serve must back off before asking again, not spin.
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return [rank for rank in ranks if rank]


class PrefixAffinityRouter(_RankingRouter):
    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         recent_ttl_s: float = 10.0) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.index = PrefixIndex(recent_ttl_s)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve calls this with every change of a replica's routing stats, where replicas publish their keys."""
        super().update_replicas(replicas)
        for r in replicas:
            report = r.routing_stats
            if "keys" in report:
                self.index.update_snapshot(r.replica_id.unique_id, report["version"], report["keys"],
                                           report.get("capacity_blocks"))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        keys = _routing_keys(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cached = {rid: self.index.num_cached_blocks(rid, keys) for rid in by_id}
        loads = {rid: self.replica_queue_len_cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        pressures = {rid: self.index.pressure(rid) for rid in by_id}
        ranked = rank_replicas(cached, loads, self.imbalance_threshold, pressures=pressures, num_blocks=len(keys))
        order = [by_id[rid] for rid in ranked]
        if keys:
            # Count the request on its first choice now: requests arriving together are ranked concurrently, before
            # Serve confirms any of them (on_request_routed), and must not all see the same empty replica.
            self.index.record_routed(order[0].replica_id.unique_id, keys)
        return self._ranked(pending_request, [order[:1], order[1:]])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        keys = _routing_keys(pending_request)
        if keys:
            self.index.record_routed(replica_id.unique_id, keys)


class PowerOfTwoRouter(_RankingRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        rest = [r for r in candidate_replicas if r not in pair]
        return self._ranked(pending_request, [pair, rest])  # Serve sends to the less loaded of the pair


class RoundRobinRouter(_RankingRouter):
    def initialize_state(self) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(replicas)
        order = replicas[first:] + replicas[:first]
        return self._ranked(pending_request, [order[:1], order[1:]])


ROUTERS = {"prefix": PrefixAffinityRouter, "pow2": PowerOfTwoRouter, "round-robin": RoundRobinRouter}


def _routing_keys(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return getattr(pending_request.args[0], "routing_keys", ())
