"""Memory of common GPUs, by the names `--gpu` accepts."""
from __future__ import annotations

from kvserve.planner.units import GiB

# Nominal capacity taken as GiB, the way the cards are quoted; nvidia-smi reports slightly less
# (an H100 80GB shows 79.6 GiB), which --gpu-memory-utilization covers.
GPU_MEMORY_GIB = {
    "rtx-3090": 24,
    "rtx-4090": 24,
    "rtx-5090": 32,
    "rtx-6000-ada": 48,
    "rtx-pro-6000": 96,
    "a10": 24,
    "a10g": 24,
    "l4": 24,
    "l40s": 48,
    "a6000": 48,
    "v100-16": 16,
    "v100-32": 32,
    "a100-40": 40,
    "a100-80": 80,
    "h100-80": 80,
    "h100-94": 94,
    "h200-141": 141,
    "gh200-96": 96,
    "b200": 180,
    "mi300x": 192,
}
_ALIASES = {
    "4090": "rtx-4090", "rtx4090": "rtx-4090", "3090": "rtx-3090", "5090": "rtx-5090",
    "a100": "a100-80", "h100": "h100-80", "h200": "h200-141",
}


def gpu_memory_bytes(name: str) -> int:
    """Memory of a known GPU; ValueError listing the known names otherwise."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in GPU_MEMORY_GIB:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_MEMORY_GIB)} (or give --gpu-memory SIZE)")
    return GPU_MEMORY_GIB[key] * GiB
