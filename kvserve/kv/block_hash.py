"""Chained content hashes of full KV blocks: a block's key names its whole prefix, not just its tokens."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None,
               namespace: str = "") -> BlockHash:
    """sha256 over (parent key, token ids[, salt]); the salt and the namespace (what the block's bytes mean: the
    storage format) only enter the first block, so they taint the whole chain."""
    h = hashlib.sha256(parent or b"root:" + namespace.encode())
    if parent is None and cache_salt is not None:
        h.update(b"salt:" + cache_salt.encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, known: Sequence[BlockHash] = (),
    namespace: str = "",
) -> list[BlockHash]:
    """Keys of every full block of `token_ids`, reusing the already-computed prefix `known`."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], cache_salt, namespace))
    return hashes
