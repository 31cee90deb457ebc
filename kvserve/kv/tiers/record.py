"""The disk tier's record format: one block of one layer group as a safetensors file, its tensors exactly as the
pool holds them, with metadata naming the model fingerprint, the block's key, its parent key, its token ids and a
CRC-32 of its tensors. A hybrid model's state checkpoint is a record of its own kind (STATE): the state after a
block (every linear layer's conv tail and recurrent state, float32), under that block's key, parent and tokens.
A reader checks all of them against what the request expects, so a damaged, truncated, foreign or mismatched file
is rejected (RecordRejected, by kind), never a wrong answer. The fingerprint names what the bytes mean (weights,
tokenizer, config, layer layout, block size, KV format)."""
from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from kvserve.kv.block_hash import BlockHash

RECORD_FORMAT = "kvserve-kv-block"
RECORD_VERSION = "2"  # bump when what a record's tensors mean changes: old records then belong to no fingerprint
# Files whose bytes decide a block's K/V (besides the weights): the config (layers, heads, RoPE, windows) and the
# tokenizer (which ids the keys chain over).
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
# Why a record was not used (kvserve:kv_disk_cache_errors{kind}): damaged, not the block asked for, not a record of
# this model, an I/O error, a write error; not a regular file (a directory, FIFO, symlink...), larger than any record
# of the pool's block can be, could not be removed once rejected (skipped from then on), out of file descriptors,
# read for longer than the tier waits, or an error the tier did not foresee.
ERROR_KINDS = ("corrupt", "mismatch", "foreign", "read", "write", "not_regular", "oversized", "unremovable",
               "fd_limit", "timeout", "unexpected")
# A record's safetensors header, at most: fixed metadata (format, version, fingerprint, keys, checksum), an entry
# per tensor, and the token ids as a JSON list (up to 20 digits and a separator each).
HEADER_FIXED_BYTES = 4096
HEADER_BYTES_PER_TENSOR = 256
HEADER_BYTES_PER_TOKEN = 24


def model_fingerprint(model_path: Path, **facts: object) -> dict[str, str]:
    """What stored bytes mean: sha256 of the model's weights, config and tokenizer files, plus `facts` (KV format,
    block size, dtype, layout...). "digest" hashes all of it; it is the store's key namespace."""
    parts = {path.name: _file_sha256(path) for path in sorted(Path(model_path).iterdir())
             if path.suffix == ".safetensors" or path.name in MODEL_FILES}
    parts.update({name: str(value) for name, value in facts.items()})
    parts["record_version"] = RECORD_VERSION
    return {**parts, "digest": hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()}


_file_digests: dict[tuple[str, int, int], str] = {}  # a weights file is hashed once per process


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _file_digests:
        digest = hashlib.sha256()
        with open(path, "rb") as file:
            while chunk := file.read(1 << 24):
                digest.update(chunk)
        _file_digests[memo] = digest.hexdigest()
    return _file_digests[memo]


@dataclass(frozen=True)
class RecordKind:
    """What a record holds: its metadata's format and its file's suffix (a record of one kind is never read as
    the other: the format is checked)."""

    name: str
    format: str
    suffix: str


BLOCK = RecordKind("block", RECORD_FORMAT, ".kvblock")
STATE = RecordKind("state", "kvserve-state-checkpoint", ".kvstate")


@dataclass(frozen=True)
class BlockRecord:
    """One block's contents (or, of kind STATE, the state checkpoint after it) on their way to disk, with what a
    reader checks them against."""

    key: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    tensors: list[torch.Tensor]
    kind: RecordKind = BLOCK

    @property
    def name(self) -> tuple[str, BlockHash]:
        """The record among those queued: a block and the state after it share a key."""
        return self.kind.name, self.key

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def tensors_crc32(tensors: Sequence[torch.Tensor | memoryview]) -> str:
    """The CRC-32 of the tensors' bytes, in order: a record's checksum. It guards against damage (a torn, truncated
    or bit-flipped file); what the record claims to be is checked against the request's own key chain and tokens.
    zlib's CRC is faster than sha256 over the same bytes, and releases the GIL while it runs."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor if isinstance(tensor, memoryview) else _bytes_of(tensor), crc)
    return f"{crc:08x}"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def encode_record(fingerprint: str, record: BlockRecord) -> bytes:
    """A safetensors file: the block's tensors t0..tn, and metadata naming the model, the key chain and tokens."""
    metadata = {"format": record.kind.format, "version": RECORD_VERSION, "fingerprint": fingerprint,
                "key": record.key.hex(), "parent": record.parent.hex() if record.parent else "",
                "token_ids": json.dumps(list(record.token_ids)), "crc32": tensors_crc32(record.tensors)}
    return safetensors.torch.save({f"t{i}": t.contiguous() for i, t in enumerate(record.tensors)}, metadata)


def max_record_bytes(specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], num_tokens: int) -> int:
    """The largest a record of a block of `num_tokens` tokens whose tensors are `specs` can be: a larger file is
    rejected before it is read."""
    tensor_bytes = sum(dtype.itemsize * math.prod(shape) for dtype, shape in specs)
    return 8 + HEADER_FIXED_BYTES + HEADER_BYTES_PER_TENSOR * len(specs) + HEADER_BYTES_PER_TOKEN * num_tokens \
        + tensor_bytes


def _header(data: bytes | bytearray) -> dict:
    """A safetensors file's header (8-byte little-endian length, then JSON): tensor entries and __metadata__."""
    (length,) = struct.unpack("<Q", data[:8])
    if not 2 <= length <= len(data) - 8:
        raise ValueError(f"header length {length} outside the file's {len(data)} bytes")
    return json.loads(data[8 : 8 + length])


def record_metadata(data: bytes | bytearray) -> dict[str, str]:
    """The metadata of a safetensors file's bytes."""
    return _header(data)["__metadata__"]


class RecordRejected(Exception):
    """A record that must not be used: `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
                       torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
                       torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def decode_record(data: bytearray, fingerprint: str, key: BlockHash, parent: BlockHash | None,
                  token_ids: Sequence[int], specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
                  kind: RecordKind = BLOCK) -> list[torch.Tensor]:
    """The tensors of a record if it is exactly the block asked for; raises RecordRejected otherwise. The tensors are
    views of `data` (no copy): each entry of the safetensors header must be the dtype and shape the pool expects,
    and lie within the file, and their bytes must match the record's checksum."""
    tensors, checksum = parse_record(data, fingerprint, key, parent, token_ids, specs, kind)
    if not checksum.matches():
        raise RecordRejected("corrupt", "checksum mismatch")
    return tensors


@dataclass(frozen=True)
class Checksum:
    """A record's tensors' bytes and the CRC-32 its metadata gives for them (checked apart from the parse: the
    disk tier checks a prefix's records on another thread while it reads the next ones)."""

    views: list[memoryview]
    expected: str | None

    def matches(self) -> bool:
        return tensors_crc32(self.views) == self.expected


def parse_record(data: bytearray, fingerprint: str, key: BlockHash, parent: BlockHash | None,
                 token_ids: Sequence[int], specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
                 kind: RecordKind = BLOCK) -> tuple[list[torch.Tensor], Checksum]:
    """decode_record but for the checksum, which it returns to be checked."""
    try:
        header = _header(data)
        metadata = header.pop("__metadata__")
    except Exception as exc:
        raise RecordRejected("foreign", f"not a safetensors file ({type(exc).__name__})") from exc
    if not isinstance(metadata, dict) or metadata.get("format") != kind.format:
        raise RecordRejected("foreign", f"not a kvserve {kind.name} record")
    if metadata.get("version") != RECORD_VERSION or metadata.get("fingerprint") != fingerprint:
        raise RecordRejected("foreign", "written for another model, format or kvserve record version")
    expected = {"key": key.hex(), "parent": parent.hex() if parent else "", "token_ids": json.dumps(list(token_ids))}
    wrong = [name for name, value in expected.items() if metadata.get(name) != value]
    if wrong:
        raise RecordRejected("mismatch", f"its {', '.join(wrong)} differ from the request's")
    start = 8 + struct.unpack("<Q", data[:8])[0]
    if len(header) != len(specs):
        raise RecordRejected("mismatch", f"its tensors' dtypes or shapes differ from the {kind.name}'s")
    views, tensors = [], []
    for i, (dtype, shape) in enumerate(specs):
        entry = header.get(f"t{i}")
        if not isinstance(entry, dict) or entry.get("dtype") != _SAFETENSORS_DTYPES.get(dtype) \
                or tuple(entry.get("shape", ())) != shape:
            raise RecordRejected("mismatch", f"its tensors' dtypes or shapes differ from the {kind.name}'s")
        try:
            begin, end = (start + int(offset) for offset in entry["data_offsets"])
        except Exception as exc:
            raise RecordRejected("corrupt", f"unreadable tensor offsets ({type(exc).__name__})") from exc
        if not start <= begin <= end <= len(data) or end - begin != dtype.itemsize * math.prod(shape):
            raise RecordRejected("corrupt", "a tensor lies outside the file (truncated?)")
        views.append(memoryview(data)[begin:end])
        tensors.append(torch.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=begin).view(shape))
    return tensors, Checksum(views, metadata.get("crc32"))

