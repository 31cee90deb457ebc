"""Model weights: bytes for a weights dtype (the parameter count comes from planner/parameters.py)."""
from __future__ import annotations

from kvserve.planner.model_spec import ModelSpec

# Stored bits per parameter. The int4 / GGUF entries include their scales: GPTQ/AWQ int4 keeps an fp16
# scale and zero point per 128 weights (4.25 bits); GGUF q8_0 / q4_0 / q4_1 pack 32 weights with an fp16
# scale (and, for q4_1, an fp16 minimum).
WEIGHT_BITS = {
    "fp32": 32.0, "float32": 32.0,
    "bf16": 16.0, "bfloat16": 16.0, "fp16": 16.0, "float16": 16.0,
    "fp8": 8.0, "int8": 8.0,
    "int4": 4.25,
    "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0,
}


def weights_bytes(spec: ModelSpec, weights_dtype: str = "auto") -> int:
    """Bytes of the weights: the file's own size for "auto" on a GGUF, else parameters × dtype bits."""
    if weights_dtype == "auto" and spec.weights_bytes is not None:
        return spec.weights_bytes
    dtype = spec.torch_dtype if weights_dtype == "auto" else weights_dtype
    if dtype not in WEIGHT_BITS:
        raise ValueError(f"unknown weights dtype {dtype!r}; known: {', '.join(WEIGHT_BITS)}")
    if spec.num_parameters is None:
        raise ValueError(f"cannot estimate the parameter count of {spec.name} from its config; pass --weights-gib")
    return round(spec.num_parameters * WEIGHT_BITS[dtype] / 8)
