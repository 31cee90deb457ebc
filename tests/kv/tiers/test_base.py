"""The interface between the KV cache manager and a tier below the pool (kv/tiers/base.py): the manager, with a
stand-in tier holding every record, reads what the pool lacks into pool blocks, as many as it has free, up to the
first bad record, and counts the tokens the tier supplied; a hybrid model's manager reads no block past the deepest
state checkpoint and resumes there; the disk tier offers every call the manager makes."""
from dataclasses import dataclass

from kvserve.kv.block_hash import hash_full_blocks
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.kv.tiers.base import KVTier, TierRead
from kvserve.kv.tiers.disk import DiskKVCache, PrefixRead
from tests.kv.tiers.disk_records import BS


class StandInRead:
    def __init__(self, loads, bad_key):
        self.loads = loads
        self.bad_key = bad_key

    def done(self) -> bool:
        return True

    def finish(self) -> int:
        keys = [load.key for load in self.loads]
        return keys.index(self.bad_key) if self.bad_key in keys else len(keys)


class StandInTier:
    def __init__(self, bad_key: bytes | None = None):
        self.bad_key = bad_key
        self.num_hit_tokens = 0
        self.reads: list[list[int]] = []
        self.find_block = None

    def attach_pool(self, find_block) -> None:
        self.find_block = find_block

    def count_hit_tokens(self, num_tokens: int) -> None:
        self.num_hit_tokens += num_tokens

    def contains(self, key: bytes) -> bool:
        return True

    def worth_reading(self, num_records: int, num_tokens: int, num_states: int = 0) -> bool:
        return True

    def start_reading(self, loads, states=()):
        self.reads.append([load.block_id for load in loads])
        return StandInRead(loads, self.bad_key)


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def manager_with_pool_hits(num_blocks: int, num_pool_hits: int, tier) -> tuple[KVCacheManager, Seq, list[bytes]]:
    """A manager whose pool caches the first `num_pool_hits` blocks of a 97-token prompt (6 full blocks)."""
    kv = KVCacheManager(num_blocks, BS, disk=tier)
    seq = Seq("r", list(range(97)))
    keys = hash_full_blocks(seq.token_ids, BS)
    for block, key in zip(kv.pool.allocate(num_pool_hits), keys):
        kv.pool.register(block, key)
        kv.pool.free([block])
    return kv, seq, keys


def test_the_manager_reads_what_the_pool_lacks_and_admission_takes_it():
    tier = StandInTier()
    kv, seq, keys = manager_with_pool_hits(16, 2, tier)
    assert kv.prefix_loading(seq) and kv.pool.num_used_blocks == 2 + 4  # the pool's hits held, 4 blocks read into
    kv.collect_loads()
    assert not kv.prefix_loading(seq) and kv.pool.num_used_blocks == 0
    assert kv.find_cached_prefix(seq).num_blocks == 6 and tier.num_hit_tokens == 4 * BS


def test_a_pool_short_of_blocks_reads_what_fits():
    tier = StandInTier()
    kv, seq, _ = manager_with_pool_hits(4, 2, tier)  # 2 free blocks once the 2 hits are held
    assert kv.prefix_loading(seq) and len(tier.reads[0]) == 2
    kv.collect_loads()
    assert kv.find_cached_prefix(seq).num_blocks == 4 and kv.pool.num_used_blocks == 0
    assert not kv.prefix_loading(seq)  # one read per admission, even though the disk holds more


def test_a_read_failing_halfway_keeps_the_blocks_before_it_and_frees_the_rest():
    keys = hash_full_blocks(list(range(97)), BS)
    kv, seq, _ = manager_with_pool_hits(16, 1, StandInTier(bad_key=keys[3]))
    assert kv.prefix_loading(seq)
    kv.collect_loads()
    assert kv.find_cached_prefix(seq).num_blocks == 3
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_cached_blocks == 3


def test_freeing_a_request_whose_prefix_is_being_read_gives_its_blocks_back():
    kv, seq, _ = manager_with_pool_hits(16, 2, StandInTier())
    assert kv.prefix_loading(seq)
    kv.free(seq)
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_cached_blocks == 2
    kv.collect_loads()  # nothing left to collect
    assert kv.pool.num_used_blocks == 0


def test_the_manager_attaches_its_pool_once_to_say_which_block_holds_a_key():
    tier = StandInTier()
    kv, _, keys = manager_with_pool_hits(16, 2, tier)
    held = [kv.pool.lookup(key).block_id for key in keys[:2]]
    assert [tier.find_block(key) for key in keys[:3]] == [*held, None]


def methods(protocol) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


def test_the_disk_tier_offers_every_call_of_the_interface():
    assert methods(KVTier) == {"attach_pool", "attach_checkpoints", "contains", "worth_reading", "start_reading",
                               "save", "save_state", "contains_state", "count_hit_tokens", "stats"}
    assert all(callable(getattr(DiskKVCache, name, None)) for name in methods(KVTier))
    assert methods(TierRead) == {"done", "wait", "finish", "put_state"}
    assert all(callable(getattr(PrefixRead, name, None)) for name in methods(TierRead))


class StandInStateRead(StandInRead):
    def __init__(self, loads, states):
        super().__init__(loads, None)
        self.states = states
        self.state = None
        self.put_into = None

    def finish(self) -> int:
        self.state = next((s for s in self.states if s.num_loads <= len(self.loads) and not s.held), None)
        return len(self.loads)

    def put_state(self, slot: int) -> None:
        self.put_into = slot


class StandInStateTier(StandInTier):
    """Holds every block, and the state checkpoints after the blocks of `state_keys`."""

    def __init__(self, state_keys):
        super().__init__()
        self.state_keys = set(state_keys)
        self.read = None
        self.find_slot = None

    def attach_checkpoints(self, find_slot) -> None:
        self.find_slot = find_slot

    def contains_state(self, key: bytes) -> bool:
        return key in self.state_keys

    def start_reading(self, loads, states=()):
        self.reads.append([load.block_id for load in loads])
        self.read = StandInStateRead(loads, states)
        return self.read


def test_a_hybrid_reads_up_to_its_deepest_checkpoint_and_resumes_there():
    keys = hash_full_blocks(list(range(97)), BS)
    tier = StandInStateTier([keys[1], keys[3]])  # 6 blocks on the tier, states after blocks 2 and 4
    kv = KVCacheManager(16, BS, disk=tier, state_slots=2, state_checkpoints=2)
    seq = Seq("r", list(range(97)))
    assert kv.prefix_loading(seq) and len(tier.reads[0]) == 4  # no block past the deepest checkpoint
    assert [(s.key, s.num_loads, s.held) for s in tier.read.states] == [(keys[3], 4, False), (keys[1], 2, False)]
    kv.collect_loads()
    hit = kv.find_cached_prefix(seq)
    assert hit.num_blocks == 4 and hit.state_checkpoint == tier.read.put_into == kv.checkpoints.lookup(keys[3])
    assert tier.num_hit_tokens == 4 * BS and kv.disk_hit_tokens(seq, 4 * BS) == 4 * BS
