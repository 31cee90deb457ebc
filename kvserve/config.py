"""Engine configuration as the user gives it (immutable); derived numbers live in the planner's KVCachePlan."""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Names, not torch dtypes: the CLI builds its parsers from this module, and must not wait for torch to import.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # 1 GiB: holds ~23K SmolLM2 tokens in float32 on a CPU box

_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
               "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from 1073741824, "1GiB", "512 MiB" or "2GB"; rejects negatives and unknown units."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"cannot read {value!r} as a size; use bytes or a unit like '2GiB' or '512MiB'")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return int(number * _SIZE_UNITS[unit])


def canonical_dtype(name: str) -> str:
    """The supported dtype name for `name` or one of its aliases ("bf16" -> "bfloat16")."""
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {sorted(DTYPES)}")
    return key


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name, an alias or a torch dtype; torch is imported here, when first needed."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, canonical_dtype(name))


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for. `None` means: take it from the model (max_model_len) or a documented default."""

    model: str | None = None
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        canonical_dtype(self.dtype)
        kv_dtype = DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if kv_dtype != "auto" and kv_dtype != DTYPE_ALIASES.get(self.dtype, self.dtype):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported yet; use 'auto' (= dtype {self.dtype!r})"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def kv_cache_memory_bytes(self) -> int:
        if self.kv_cache_memory is None:
            return DEFAULT_KV_CACHE_MEMORY_BYTES
        return parse_size(self.kv_cache_memory)
