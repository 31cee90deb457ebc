"""What the block-table tests share: a stand-in sequence and admitting one the way the scheduler does."""
from dataclasses import dataclass, field

from kvserve.kv.kv_cache_manager import KVCacheManager

BS = 16


@dataclass
class Seq:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def prefill(kv: KVCacheManager, seq: Seq) -> None:
    """Admit and compute the whole prompt, using cached blocks, as the scheduler does."""
    cached = kv.find_cached_prefix(seq)
    assert kv.allocate(seq, len(seq.token_ids) - cached.num_blocks * BS, cached) == []
    seq.num_computed_tokens = len(seq.token_ids)
    kv.cache_full_blocks(seq)
