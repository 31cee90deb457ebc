"""A replica's side of prefix routing: the routing keys of the blocks its prefix cache holds, kept current from the
block pool's hash events, plus those of the requests it is serving (their blocks are being prefilled)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvserve.kv.block_pool import BlockPool
from kvserve.scaleout.prefix_index import pack_keys, routing_key


class PublishedBlocks:
    """Call `snapshot` from one thread (the replica's event loop) while the engine thread keeps stepping."""

    def __init__(self, pool: BlockPool):
        self._events = pool.subscribe_hash_events()
        # counts, not a set: a hybrid model caches one block per layer group under the same routing key
        self._cached: Counter[bytes] = Counter()
        self._serving: Counter[bytes] = Counter()

    def start_serving(self, keys: Sequence[bytes]) -> None:
        self._serving.update(keys)

    def stop_serving(self, keys: Sequence[bytes]) -> None:
        self._serving.subtract(keys)
        for key in keys:
            if self._serving[key] <= 0:
                del self._serving[key]

    def snapshot(self) -> bytes:
        """Every key a request routed here now would find cached (or about to be), packed."""
        self._drain()
        return pack_keys(set(self._cached) | set(self._serving))

    def _drain(self) -> None:
        while True:
            try:
                stored, block_hash = self._events.popleft()
            except IndexError:
                return
            key = routing_key(block_hash)
            if stored:
                self._cached[key] += 1
            else:
                self._cached[key] -= 1
                if self._cached[key] <= 0:
                    del self._cached[key]
