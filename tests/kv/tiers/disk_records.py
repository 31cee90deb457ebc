"""Shared by the disk tier's tests: a store under a test directory, a prompt's key chain and records of random bytes."""
import hashlib
from pathlib import Path

import torch

from kvserve.kv.block_hash import hash_block
from kvserve.kv.formats import make_kv_cache
from kvserve.kv.tiers.record import BlockRecord
from kvserve.kv.tiers.store import DiskBlockStore
from kvserve.planner.layout import KVLayout

BS, BLOCKS = 16, 6


def fingerprint(name: str = "model-a") -> dict[str, str]:
    return {"model": name, "digest": hashlib.sha256(name.encode()).hexdigest()}


def store(directory: Path, capacity_bytes: int = 1 << 30, name: str = "model-a") -> DiskBlockStore:
    return DiskBlockStore(directory, capacity_bytes, fingerprint(name))


def random_cache(format_name: str, layout: KVLayout, seed: int = 0):
    """A cache of `format_name` whose block tensors hold random bytes (every bit pattern, NaNs included)."""
    cache = make_kv_cache(format_name, layout, BLOCKS, BS, 2, 16, torch.float32, compile=False)
    g = torch.Generator().manual_seed(seed)
    for tensor in cache._block_tensors():
        raw = tensor.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return cache


def chain(num_blocks: int, salt: str | None = None) -> tuple[list[bytes], list[list[int]]]:
    """Keys and token ids of a prompt of `num_blocks` full blocks."""
    tokens = [list(range(i * BS, (i + 1) * BS)) for i in range(num_blocks)]
    keys = []
    for block in tokens:
        keys.append(hash_block(keys[-1] if keys else None, block, salt, "float32"))
    return keys, tokens


def record(i: int, keys, tokens, nbytes: int = 4096) -> BlockRecord:
    g = torch.Generator().manual_seed(i)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return BlockRecord(keys[i], keys[i - 1] if i else None, tuple(tokens[i]), list(payload.chunk(2)))


SPECS = [(torch.uint8, (2048,))] * 2


def written(s: DiskBlockStore, *records: BlockRecord) -> None:
    for r in records:
        s.submit(r)
    assert s.flush(10)


def as_bytes(tensors) -> list[bytes]:
    return [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor bytes
    path.write_bytes(bytes(data))
