"""The prefix router's picture of what each replica has cached, and its choice of replica for a request.

A key is a prefix of a block's chained hash (kvserve/kv/block_hash.py): it names the whole prompt prefix up to and
including that block, so a request's keys in order, compared with a replica's set, give the number of leading
blocks that replica can reuse. A collision could only misroute a request; it never touches what the engine computes."""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

KEY_BYTES = 8
# A request's cached run must cover this share of its blocks to pull it to a replica; below it, the request is
# placed like a new conversation, where the cache has most room. A new conversation shares at most a system
# prompt with others; a returning one finds its whole previous prompt, most of the new one.
MIN_AFFINITY_SHARE = 0.5


def routing_key(block_hash: bytes) -> bytes:
    """The part of a block hash that routing compares (a hybrid model's per-group suffix falls away too)."""
    return block_hash[:KEY_BYTES]


def pack_keys(keys: Iterable[bytes]) -> bytes:
    """Keys as one compact blob, the form replicas publish them in."""
    return b"".join(keys)


def unpack_keys(blob: bytes) -> frozenset[bytes]:
    return frozenset(blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES))


class PrefixIndex:
    """Per replica: the keys of its last published snapshot, plus the keys of requests routed to it since, which the
    snapshots (taken every few seconds) may not show yet; those expire after `recent_ttl_s`.

    It also keeps each replica's working set: the distinct keys routed to it within the last `working_set_s`, i.e.
    the blocks its live conversations ask it to keep (a conversation that moves leaves the working set it had).
    Against the replica's published capacity that is its cache pressure; a new conversation goes where it is
    lowest, so no replica is handed more conversations than its cache holds while another has room."""

    def __init__(self, recent_ttl_s: float, working_set_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic):
        self.recent_ttl_s = recent_ttl_s
        self.working_set_s = working_set_s
        self._clock = clock
        self._snapshots: dict[str, frozenset[bytes]] = {}
        self._versions: dict[str, object] = {}
        self._capacities: dict[str, int] = {}
        self._recent: dict[str, OrderedDict[bytes, float]] = {}  # key -> expiry, oldest first
        self._working: dict[str, OrderedDict[bytes, float]] = {}  # key -> expiry, oldest first

    def update_snapshot(self, replica: str, version: object, blob: bytes, capacity_blocks: int | None = None) -> None:
        """Take a replica's published keys, unless this version is the one already taken, and its capacity."""
        if capacity_blocks:
            self._capacities[replica] = capacity_blocks
        if self._versions.get(replica) != version:
            self._versions[replica] = version
            self._snapshots[replica] = unpack_keys(blob)

    def record_routed(self, replica: str, keys: Sequence[bytes]) -> None:
        """The replica is about to prefill these blocks: count them as cached there until its snapshots show them,
        and as part of its working set."""
        now = self._clock()
        for table, ttl in ((self._recent, self.recent_ttl_s), (self._working, self.working_set_s)):
            entries = _expire(table.setdefault(replica, OrderedDict()), now)
            for key in keys:
                entries.pop(key, None)
                entries[key] = now + ttl
        for other, entries in self._working.items():  # a conversation lives where its latest turn went
            if other != replica:
                for key in keys:
                    entries.pop(key, None)

    def forget(self, replica: str) -> None:
        for table in (self._snapshots, self._versions, self._capacities, self._recent, self._working):
            table.pop(replica, None)

    def working_set_blocks(self, replica: str) -> int:
        return len(_expire(self._working.get(replica, OrderedDict()), self._clock()))

    def pressure(self, replica: str) -> float:
        """Working set over capacity (over 1 block until the replica has published its capacity)."""
        return self.working_set_blocks(replica) / self._capacities.get(replica, 1)

    def num_cached_blocks(self, replica: str, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the replica holds."""
        snapshot = self._snapshots.get(replica, frozenset())
        recent = self._recent.get(replica, {})
        now = self._clock()
        for i, key in enumerate(keys):
            if key not in snapshot and recent.get(key, 0.0) <= now:
                return i
        return len(keys)


def _expire(entries: OrderedDict[bytes, float], now: float) -> OrderedDict[bytes, float]:
    while entries and next(iter(entries.values())) <= now:
        entries.popitem(last=False)
    return entries


def rank_replicas(cached_blocks: dict[str, int], loads: dict[str, int], imbalance_threshold: int,
                  rng: random.Random | None = None, pressures: dict[str, float] | None = None,
                  num_blocks: int = 0) -> list[str]:
    """Replica ids best first, for a request of `num_blocks` full blocks. While the busiest replica has at most
    `imbalance_threshold` more requests than the idlest, the longest cached prefix wins, then the lower cache
    pressure, then the lighter load; past it, the lighter load wins. A cached run shorter than MIN_AFFINITY_SHARE
    of the request earns no affinity (a shared system prompt must not pull every new conversation to the replica
    that saw it first); a request without a full block goes by load alone. Exact ties are broken at random so
    idle replicas share new conversations."""
    replicas = list(cached_blocks)
    (rng or random).shuffle(replicas)
    pressure = pressures or {}
    imbalanced = max(loads.values()) - min(loads.values()) > imbalance_threshold
    if imbalanced:
        return sorted(replicas, key=lambda r: (loads[r], -cached_blocks[r]))
    if not num_blocks:  # nothing to cache: only the load matters
        return sorted(replicas, key=lambda r: loads[r])
    if max(cached_blocks.values()) < MIN_AFFINITY_SHARE * num_blocks:
        return sorted(replicas, key=lambda r: (pressure.get(r, 0.0), loads[r]))
    return sorted(replicas, key=lambda r: (-cached_blocks[r], pressure.get(r, 0.0), loads[r]))
