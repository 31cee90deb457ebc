"""KV cache sizes: bytes per element, per token and per request, including quantization scales.

How kvserve stores each KV dtype (the scales are part of the cache, so they are part of its size; the engine's
storage formats in kvserve/kv/ allocate exactly this, and a test holds them to it):
- bf16 / fp16 / fp32: plain elements, no scales.
- fp8 (e4m3) / fp8_e5m2: 1 byte per element plus one fp16 scale per token, layer and head vector (dynamic,
  symmetric): 2 bytes per KV head for K and again for V; for MLA 2 bytes per cached latent.
- int8: the same layout with int8 elements.
- int4 (KIVI): 2 elements per byte; values carry an fp16 scale and an fp16 zero point per token and head
  vector; keys carry them per channel per block (one pair for each of head_dim channels, shared by the
  block's tokens): head_dim x 4 / block_size bytes per token and head. For MLA the latent is treated as a value.
- nuq4 / nuq3 / nuq3k4v (kv/formats/nonuniform.py): head_dim x 4 or x 3 bits of codes for K and for V (nuq3k4v:
  3-bit keys, 4-bit values); values carry one fp16 scale per token, layer and head vector;
  keys an fp16 midpoint and a half range (fp16 for nuq4, 1 byte for the others) per channel per block: head_dim x 4
  (x 3 with the 1-byte half range) / block_size bytes per token and head.

`--kv-scales per-tensor` plans fp8, fp8_e5m2 or int8 as an engine that keeps one scale per layer for K and one
for V instead (vLLM's FP8 KV cache): no scale bytes per token, exactly half of bf16.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.planner.layout import KVLayout
from kvserve.planner.model_spec import FULL, LINEAR, SLIDING, ModelSpec

NO_SCALE = "none"
PER_VECTOR = "vector"  # one scale (and zero point) per token, layer and head vector
PER_CHANNEL = "channel"  # one scale (and zero point) per element position per block, shared by the block's tokens
PER_TENSOR = "tensor"  # one scale per layer for K and one for V, outside the blocks: nothing per token
PER_TOKEN_HEAD_SCALES, PER_TENSOR_SCALES = "per-token-head", "per-tensor"
KV_SCALES_CHOICES = (PER_TOKEN_HEAD_SCALES, PER_TENSOR_SCALES)  # --kv-scales; the first is kvserve's storage
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVDtype:
    """How one KV element is stored, and what its quantization scales cost per stored vector."""

    name: str
    element_bits: int
    scale_scope: str = NO_SCALE
    scale_bytes: int = 0
    zero_point_bytes: int = 0
    key_scale_scope: str | None = None  # keys scaled differently from values (KIVI: PER_CHANNEL)
    key_scale_bytes: int | None = None  # the keys' own scale and zero point bytes (None: the values')
    key_zero_point_bytes: int | None = None
    codebook: bool = False  # value codes index a fixed non-uniform codebook of rotated coordinates (nuq4, nuq3)
    key_element_bits: int | None = None  # keys stored with other bits than values (None: element_bits)
    tokens_per_byte_plane: int = 1  # codes packed across a block's tokens: block_size must be a multiple of this

    def bits(self, key: bool) -> int:
        """Bits of one stored key (key=True) or value element."""
        return self.key_element_bits if key and self.key_element_bits is not None else self.element_bits

    @property
    def scales(self) -> str:
        """Where this format keeps its scales, in --kv-scales words ("none" for plain elements)."""
        if self.key_scale_scope == PER_CHANNEL:
            return "per-channel keys, per-token-head values"
        return {NO_SCALE: "none", PER_VECTOR: PER_TOKEN_HEAD_SCALES, PER_TENSOR: PER_TENSOR_SCALES}[self.scale_scope]

    def scope(self, key: bool) -> str:
        return self.key_scale_scope if key and self.key_scale_scope else self.scale_scope

    def stat_bytes(self, key: bool) -> tuple[int, int]:
        """Bytes of one scale and of one zero point of keys (key=True) or values."""
        if key and self.key_scale_bytes is not None:
            return self.key_scale_bytes, self.key_zero_point_bytes or 0
        return self.scale_bytes, self.zero_point_bytes

    def vector_bytes(self, elements: int, block_size: int = DEFAULT_BLOCK_SIZE, key: bool = False) -> int:
        """Bytes one stored vector of `elements` values takes per token, scales included."""
        data = -(-elements * self.bits(key) // 8)
        per_scale = sum(self.stat_bytes(key))
        scope = self.scope(key)
        if scope == PER_VECTOR:
            return data + per_scale
        if scope == PER_CHANNEL:
            if elements * per_scale % block_size:
                raise ValueError(f"{self.name} keeps {per_scale} bytes per channel per block: block_size "
                                 f"{block_size} must divide {elements * per_scale} ({elements} channels)")
            return data + elements * per_scale // block_size
        return data  # NO_SCALE, PER_TENSOR


BF16 = KVDtype("bf16", 16)
FP16 = KVDtype("fp16", 16)
FP32 = KVDtype("fp32", 32)
FP8_E4M3 = KVDtype("fp8", 8, PER_VECTOR, scale_bytes=2)
FP8_E5M2 = KVDtype("fp8_e5m2", 8, PER_VECTOR, scale_bytes=2)
INT8 = KVDtype("int8", 8, PER_VECTOR, scale_bytes=2)
INT4 = KVDtype("int4", 4, PER_VECTOR, scale_bytes=2, zero_point_bytes=2, key_scale_scope=PER_CHANNEL,
              tokens_per_byte_plane=2)
NUQ4 = KVDtype("nuq4", 4, PER_VECTOR, scale_bytes=2, key_scale_scope=PER_CHANNEL, key_scale_bytes=2,
               key_zero_point_bytes=2, codebook=True, tokens_per_byte_plane=2)
NUQ3 = KVDtype("nuq3", 3, PER_VECTOR, scale_bytes=2, key_scale_scope=PER_CHANNEL, key_scale_bytes=1,
               key_zero_point_bytes=2, codebook=True, tokens_per_byte_plane=8)
NUQ3K4V = KVDtype("nuq3k4v", 4, PER_VECTOR, scale_bytes=2, key_scale_scope=PER_CHANNEL, key_scale_bytes=1,
                  key_zero_point_bytes=2, codebook=True, key_element_bits=3, tokens_per_byte_plane=8)

KV_DTYPES = {
    "bf16": BF16, "bfloat16": BF16,
    "fp16": FP16, "float16": FP16,
    "fp32": FP32, "float32": FP32,
    "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3,
    "fp8_e5m2": FP8_E5M2,
    "int8": INT8,
    "int4": INT4,
    "nuq4": NUQ4,
    "nuq3": NUQ3,
    "nuq3k4v": NUQ3K4V,
}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)


def resolve_kv_dtype(name: str, spec: ModelSpec, kv_scales: str = PER_TOKEN_HEAD_SCALES) -> KVDtype:
    """The KVDtype for a --kv-cache-dtype value and --kv-scales; "auto" follows the model's torch_dtype."""
    if name == "auto":
        return with_kv_scales(KV_DTYPES.get(spec.torch_dtype, BF16), kv_scales)
    if name not in KV_DTYPES:
        raise ValueError(f"unknown kv cache dtype {name!r}; choose one of: {', '.join(KV_DTYPE_CHOICES)}")
    return with_kv_scales(KV_DTYPES[name], kv_scales)


def takes_kv_scales(dtype: KVDtype) -> bool:
    """Whether --kv-scales applies: a format with one scale per token and head vector (fp8, fp8_e5m2, int8) whose
    elements are not codebook indices."""
    return dtype.scale_scope == PER_VECTOR and dtype.key_scale_scope is None and not dtype.codebook


def with_kv_scales(dtype: KVDtype, kv_scales: str) -> KVDtype:
    """`dtype` with its scales per token and head vector (kvserve's storage, as defined above) or per tensor."""
    if kv_scales not in KV_SCALES_CHOICES:
        raise ValueError(f"unknown kv scales {kv_scales!r}; choose one of: {', '.join(KV_SCALES_CHOICES)}")
    if kv_scales == PER_TOKEN_HEAD_SCALES:
        return dtype
    if not takes_kv_scales(dtype):
        kept = "keeps no scales" if dtype.scale_scope == NO_SCALE else f"keeps {dtype.scales} scales"
        raise ValueError(f"--kv-scales {kv_scales} applies to fp8, fp8_e5m2 and int8; {dtype.name} {kept}")
    return replace(dtype, scale_scope=PER_TENSOR, scale_bytes=0)


def latent_words(kv_lora_rank: int, qk_rope_head_dim: int) -> str:
    """How the engine's start-up line and `kvserve plan` name what an MLA model caches."""
    return f"latent {kv_lora_rank} + rope {qk_rope_head_dim} per token and layer"


def expanded_kv_bytes_per_token(spec: ModelSpec, dtype: KVDtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int | None:
    """What an MLA model's per-head K (nope + rope) and V would take per token if cached expanded, as an
    engine without latent storage keeps them; None when the config lacks the head sizes (or it is not MLA)."""
    if not spec.is_mla or spec.qk_nope_head_dim is None or spec.v_head_dim is None:
        return None
    key = dtype.vector_bytes(spec.qk_nope_head_dim + spec.qk_rope_head_dim, block_size, key=True)
    return spec.num_kv_layers * spec.num_attention_heads * (key + dtype.vector_bytes(spec.v_head_dim, block_size))


def kv_bytes_per_token_per_layer(spec: ModelSpec, dtype: KVDtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """One token's K and V vectors in one layer (MLA: its one latent, stored like a value)."""
    if spec.is_mla:
        return dtype.vector_bytes(spec.kv_vector_elements, block_size)
    key = dtype.vector_bytes(spec.head_dim, block_size, key=True)
    return spec.num_kv_heads * (key + dtype.vector_bytes(spec.head_dim, block_size))


def kv_bytes_per_token(spec: ModelSpec, dtype: KVDtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one token adds to a uniform pool: every layer that holds KV (full and sliding attention)."""
    return spec.num_kv_layers * kv_bytes_per_token_per_layer(spec, dtype, block_size)


def round_up_to_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def request_kv_bytes(spec: ModelSpec, dtype: KVDtype, tokens: int, block_size: int) -> int:
    """KV one request of `tokens` holds in whole blocks; sliding layers never hold more than their window."""
    per_layer_block = block_size * kv_bytes_per_token_per_layer(spec, dtype, block_size)
    full_blocks = spec.num_layers_of(FULL) * round_up_to_blocks(tokens, block_size)
    sliding_blocks = 0
    if spec.sliding_window is not None:
        window_tokens = min(tokens, spec.sliding_window)
        sliding_blocks = spec.num_layers_of(SLIDING) * round_up_to_blocks(window_tokens, block_size)
    return (full_blocks + sliding_blocks) * per_layer_block


STATE_SLOT_ELEMENT_BYTES = 4  # the engine keeps linear layers' state in float32 (kvserve/kv/state_cache.py)


def state_slot_bytes(spec: ModelSpec) -> int:
    """One sequence's state slot in the engine: every linear layer's conv tail and recurrent state, float32
    (the released checkpoints' mamba_ssm_dtype); 0 when the config does not give the state's size."""
    if spec.linear_state_elements is None:
        return 0
    return spec.num_layers_of(LINEAR) * spec.linear_state_elements * STATE_SLOT_ELEMENT_BYTES


fixed_state_bytes = state_slot_bytes  # what `kvserve plan` reports per request is what the engine allocates


# eviction policies whose pool is blocks of one layer's one KV head (the engine's kv/head_streams.py), and the KV
# dtypes those blocks store (floats; int8 with a scale per token and head as the int8 format keeps; int4 with a
# scale and zero point per token and head: a slot moves alone when a stream is compacted, so no statistics per
# channel over a block as the int4 format keeps for its keys)
HEAD_STREAM_POLICIES = ("adakv", "adakv-layers", "adakv-knorm", "adakv-keydiff", "perhead", "perhead-mix",
                        "perhead-span", "perhead-observed", "perhead-observed-span", "headkv-span",
                        "headkv-observed-span")
HEAD_STREAM_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
INT4_PER_TOKEN = KVDtype("int4", 4, PER_VECTOR, scale_bytes=2, zero_point_bytes=2)


def eviction_kv_dtype(policy: str, kv_dtype: KVDtype) -> KVDtype:
    """How a KV eviction policy stores `kv_dtype`: per-head streams keep int4 keys per token (INT4_PER_TOKEN), every
    other dtype as it is. Refuses, as the engine does, a dtype the streams cannot store, and int8 with per-tensor
    scales, which they do not keep (a scale per token and head: planning without them would count fewer bytes than
    the engine holds)."""
    if policy not in HEAD_STREAM_POLICIES:
        return kv_dtype
    if kv_dtype.name not in HEAD_STREAM_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_dtype.name} is not supported with kv_eviction={policy!r} (per-head "
                         "streams store float, int8 or int4 K/V): use kv_cache_dtype auto, float32, bfloat16, "
                         "float16, int8 or int4")
    if kv_dtype.scale_scope == PER_TENSOR:
        raise ValueError(f"--kv-scales {PER_TENSOR_SCALES} is not supported with kv_eviction={policy!r} (per-head "
                         f"streams keep a scale per token and head): use --kv-scales {PER_TOKEN_HEAD_SCALES}")
    return INT4_PER_TOKEN if kv_dtype.name == "int4" else kv_dtype


def eviction_max_blocks(policy: str, sink_tokens: int, recent_tokens: int, budget_tokens: int,
                        block_size: int) -> int | None:
    """The most blocks one sequence holds under a KV eviction policy (between steps), or None when unbounded:
    streaming keeps the sink and recent-window blocks plus the one being filled; h2o its budget plus that one."""
    if policy == "streaming":
        return round_up_to_blocks(sink_tokens, block_size) + round_up_to_blocks(recent_tokens, block_size) + 1
    if policy == "h2o":
        return round_up_to_blocks(budget_tokens, block_size) + 1
    if policy in HEAD_STREAM_POLICIES:  # per-(layer, head) streams: a head holds budget_tokens on
        # average, compressed once a block more has arrived, each stream's last head block partly filled
        return round_up_to_blocks(budget_tokens, block_size) + 2
    return None


def kv_layout(spec: ModelSpec) -> KVLayout:
    """How the engine groups this model's attention layers into blocks (see kvserve/planner/layout.py)."""
    windows = [spec.sliding_window if kind == SLIDING else None for kind in spec.layer_kinds if kind != LINEAR]
    return KVLayout.from_layer_windows(windows)
