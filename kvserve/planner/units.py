"""Byte units: binary constants, human-readable formatting and parsing of memory sizes."""
from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# Binary units for the short forms (K, M, G, T) as nvidia-smi and most serving CLIs use them;
# KB/MB/GB/TB are decimal, as on spec sheets.
_UNITS = {
    "": GiB,  # a bare number is GiB: GPU memory is always quoted in gigabytes
    "b": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as "24GiB", "80GB", "512MiB" or "24" (GiB); must be positive."""
    match = _SIZE.match(str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: use a number with a unit, e.g. 24GiB, 80GB, 512MiB")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(size)


def format_bytes(num_bytes: float) -> str:
    """Binary units with two decimals past KiB: 1.00 GiB, 640.00 MiB, 128 KiB, 512 B."""
    if num_bytes >= GiB:
        return f"{num_bytes / GiB:,.2f} GiB"
    if num_bytes >= MiB:
        return f"{num_bytes / MiB:,.2f} MiB"
    if num_bytes >= KiB:
        return f"{num_bytes / KiB:,.4g} KiB"
    return f"{num_bytes:,.0f} B"
