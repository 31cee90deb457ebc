"""KV cache sizes: bytes per element, per token and per request, including quantization scales.

How kvserve stores each KV dtype (the scales are part of the cache, so they are part of its size):
- bf16 / fp16 / fp32: plain elements, no scales.
- fp8 (e4m3) / fp8_e5m2: 1 byte per element and one fp32 scale per layer for K and one for V. Those
  scales do not grow with tokens, so the per-token size is exactly half of bf16.
- int8: 1 byte per element plus one fp16 scale per token, layer and head vector (symmetric), i.e. for
  GQA 2 bytes per KV head for K and again for V; for MLA 2 bytes per cached latent.
- int4: 2 elements per byte plus an fp16 scale and an fp16 zero point per group of 32 elements
  (asymmetric, as in KIVI or llama.cpp's q4_1): 0.125 extra bytes per element.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.model_spec import FULL, LINEAR, SLIDING, ModelSpec

NO_SCALE = "none"
PER_LAYER = "layer"  # one scale per layer and tensor: no per-token cost
PER_VECTOR = "vector"  # one scale (and zero point) per token, layer and head vector
PER_GROUP = "group"  # one scale (and zero point) per group_size elements


@dataclass(frozen=True)
class KVDtype:
    """How one KV element is stored, and what its quantization scales cost per stored vector."""

    name: str
    element_bits: int
    scale_scope: str = NO_SCALE
    group_size: int = 0
    scale_bytes: int = 0
    zero_point_bytes: int = 0

    def vector_bytes(self, elements: int) -> int:
        """Bytes one stored vector of `elements` values takes, scales included."""
        data = -(-elements * self.element_bits // 8)
        per_scale = self.scale_bytes + self.zero_point_bytes
        if self.scale_scope == PER_VECTOR:
            return data + per_scale
        if self.scale_scope == PER_GROUP:
            return data + -(-elements // self.group_size) * per_scale
        return data

    def scales_per_vector(self, elements: int) -> int:
        if self.scale_scope == PER_VECTOR:
            return 1
        return -(-elements // self.group_size) if self.scale_scope == PER_GROUP else 0


BF16 = KVDtype("bf16", 16)
FP16 = KVDtype("fp16", 16)
FP32 = KVDtype("fp32", 32)
FP8_E4M3 = KVDtype("fp8", 8, PER_LAYER, scale_bytes=4)
FP8_E5M2 = KVDtype("fp8_e5m2", 8, PER_LAYER, scale_bytes=4)
INT8 = KVDtype("int8", 8, PER_VECTOR, scale_bytes=2)
INT4 = KVDtype("int4", 4, PER_GROUP, group_size=32, scale_bytes=2, zero_point_bytes=2)

KV_DTYPES = {
    "bf16": BF16, "bfloat16": BF16,
    "fp16": FP16, "float16": FP16,
    "fp32": FP32, "float32": FP32,
    "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3,
    "fp8_e5m2": FP8_E5M2,
    "int8": INT8,
    "int4": INT4,
}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)


def resolve_kv_dtype(name: str, spec: ModelSpec) -> KVDtype:
    """The KVDtype for a --kv-cache-dtype value; "auto" follows the model's torch_dtype."""
    if name == "auto":
        return KV_DTYPES.get(spec.torch_dtype, BF16)
    if name not in KV_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose one of: {', '.join(KV_DTYPE_CHOICES)}")
    return KV_DTYPES[name]


def kv_bytes_per_token_per_layer(spec: ModelSpec, dtype: KVDtype) -> int:
    return spec.kv_vectors_per_layer * dtype.vector_bytes(spec.kv_vector_elements)


def kv_bytes_per_token(spec: ModelSpec, dtype: KVDtype) -> int:
    """Bytes one token adds to a uniform pool: every layer that holds KV (full and sliding attention)."""
    return spec.num_kv_layers * kv_bytes_per_token_per_layer(spec, dtype)


def round_up_to_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def request_kv_bytes(spec: ModelSpec, dtype: KVDtype, tokens: int, block_size: int) -> int:
    """KV one request of `tokens` holds in whole blocks; sliding layers never hold more than their window."""
    per_layer_block = block_size * kv_bytes_per_token_per_layer(spec, dtype)
    full_blocks = spec.num_layers_of(FULL) * round_up_to_blocks(tokens, block_size)
    sliding_blocks = 0
    if spec.sliding_window is not None:
        window_tokens = min(tokens, spec.sliding_window)
        sliding_blocks = spec.num_layers_of(SLIDING) * round_up_to_blocks(window_tokens, block_size)
    return (full_blocks + sliding_blocks) * per_layer_block


def fixed_state_bytes(spec: ModelSpec) -> int:
    """Per-request state of the linear-attention layers, kept in the model's dtype; 0 when unknown."""
    if spec.linear_state_elements is None:
        return 0
    dtype = KV_DTYPES.get(spec.torch_dtype, BF16)
    return spec.num_layers_of(LINEAR) * dtype.vector_bytes(spec.linear_state_elements)
