"""Engine configuration as the user gives it (immutable); derived numbers live in the planner's KVCachePlan."""
from __future__ import annotations

import numbers
import os
import re
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.planner.capacity import DEFAULT_MAX_NUM_SEQS
from kvserve.planner.kv_size import HEAD_STREAM_POLICIES, KV_DTYPE_CHOICES, KV_DTYPES

if TYPE_CHECKING:
    import torch

# Names, not torch dtypes: the CLI builds its parsers from this module, and must not wait for torch to import.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
KV_EVICTION_POLICIES = ("none", "streaming", "h2o", *HEAD_STREAM_POLICIES)
QUANTIZATIONS = ("none", "int8")  # weights: as the model dtype, or int8 with per-output-channel scales
# compiled decode steps are the default; this variable set to 1 makes eager steps the default instead (an explicit
# compile_decode still decides): for a test suite, whose hundreds of short-lived engines would each compile
EAGER_STEPS_VARIABLE = "KVSERVE_EAGER_STEPS"
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


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(choices)}")


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block (vLLM's default on a GPU)
SPECULATIVE_METHODS = ("ngram", "suffix")
# Speculation stops once more sequences than this decode in one step: there the step is bound by its matmuls, and
# verifying k more tokens per sequence costs nearly k more decode steps' compute (docs/speculative.md measures it).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding without a draft model (kvserve/engine/speculative.py), in vLLM's names and shape:
    `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`.
    ngram proposes what followed the latest earlier occurrence of the last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) in the request's own prompt and output; suffix matches the longest suffix (up to
    suffix_decoding_max_tree_depth tokens) in the request and in the last suffix_decoding_max_cached_requests
    requests' outputs, and proposes up to suffix_decoding_max_spec_factor tokens per matched token. Nothing is
    proposed in a step where more than disable_by_batch_size sequences decode."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24
    # its index holds max_tree_depth entries per output token: 100 outputs of 500 tokens take ~135 MiB
    suffix_decoding_max_cached_requests: int = 100
    suffix_decoding_max_spec_factor: float = 1.0
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        _check_choice("speculative_config method", self.method, SPECULATIVE_METHODS)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests", "disable_by_batch_size"):
            _check_positive_int(f"speculative_config {name}", getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} is more than "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        factor = self.suffix_decoding_max_spec_factor
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"speculative_config suffix_decoding_max_spec_factor must be a positive number, "
                             f"got {factor!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict, or its JSON text (the CLI's --speculative-config); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object like "
                             f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r}')
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; the keys are {', '.join(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method: one of {', '.join(SPECULATIVE_METHODS)}")
        return cls(**value)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its storage format ("auto" is the model's dtype), tokens per block, the memory it may
    take (None: DEFAULT_KV_CACHE_MEMORY_BYTES) and whether full blocks are shared by prefix (kvserve/kv/)."""

    kv_cache_dtype: str
    block_size: int
    kv_cache_memory: int | str | None
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_DTYPE_CHOICES)
        _check_positive_int("block_size", self.block_size)
        plane = KV_DTYPES[self.kv_cache_dtype].tokens_per_byte_plane if self.kv_cache_dtype in KV_DTYPES else 1
        if self.block_size % plane:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} packs {plane} tokens of a block per byte: "
                             f"block_size must be a multiple of {plane}, got {self.block_size}")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)

    @property
    def kv_cache_memory_bytes(self) -> int:
        if self.kv_cache_memory is None:
            return DEFAULT_KV_CACHE_MEMORY_BYTES
        return parse_size(self.kv_cache_memory)


@dataclass(frozen=True)
class SchedulerConfig:
    """How much one step may hold: sequences, tokens, and the longest sequence (None: the model's own limit)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _check_positive_int(name, getattr(self, name))
        if self.max_model_len is not None:
            _check_positive_int("max_model_len", self.max_model_len)


@dataclass(frozen=True)
class CompileConfig:
    """How steps run. enforce_eager: never torch.compile (neither the decode steps nor the int8/int4/nuq KV formats'
    decode attention, kv/formats/compiled.py). compile_decode: decode steps as graphs compiled at start (compile/
    steps.py); None, the default, compiles them wherever the model family and settings allow (`decode_steps`), True
    asks for them, False runs them eagerly. A first start compiles for tens of seconds on a small CPU and saves the
    graphs; later starts load them (docs/benchmarks.md, `kvserve bench startup`). compile_gemms: with compiled steps,
    the weights frozen into the graph and multiplied by Inductor's C++ GEMM template over its own packed copy (faster
    decode, more memory, a start Inductor cannot cache). batch_invariant: logits bitwise independent of the batch
    (kvserve/batch_invariant.py)."""

    enforce_eager: bool
    compile_decode: bool | None
    compile_gemms: bool
    batch_invariant: bool

    def __post_init__(self) -> None:
        for name in ("enforce_eager", "batch_invariant", "compile_gemms"):
            _check_bool(name, getattr(self, name))
        if self.compile_decode is not None:
            _check_bool("compile_decode", self.compile_decode)
        if self.compile_decode and self.enforce_eager:
            raise ValueError("compile_decode=True contradicts enforce_eager=True (which compiles nothing); choose one")
        if self.compile_gemms and (self.compile_decode is False or self.enforce_eager):
            raise ValueError("compile_gemms=True applies to the compiled decode step, which "
                             f"{self.eager_reason} turns off; drop one of the two")

    @property
    def decode_steps(self) -> bool:
        """Whether decode steps are to run compiled: asked for (compile_decode, compile_gemms), or by default
        (compile_decode None) unless enforce_eager or the environment's default (EAGER_STEPS_VARIABLE) says otherwise. The engine still runs
        them eagerly where no graph supports its model or settings (compile/steps.py, `unsupported`), saying why."""
        if self.compile_decode is not None:
            return self.compile_decode
        if self.enforce_eager:
            return False
        return self.compile_gemms or os.environ.get(EAGER_STEPS_VARIABLE, "0") != "1"

    @property
    def asked(self) -> bool:
        """Compiled steps asked for (compile_decode=True, or compile_gemms=True which needs them), rather than taken
        by default."""
        return self.compile_decode is True or (self.compile_decode is None and self.compile_gemms)

    @property
    def eager_reason(self) -> str:
        """What turned compiled decode steps off (meaningful when `decode_steps` is False)."""
        if self.compile_decode is False:
            return "--no-compile-decode"
        if self.enforce_eager:
            return "--enforce-eager"
        return f"{EAGER_STEPS_VARIABLE}=1 in the environment"


@dataclass(frozen=True)
class EvictionConfig:
    """Which tokens' KV a long sequence keeps: all ("none"), the first kv_sink_tokens ("attention sinks") and the
    last kv_recent_tokens ("streaming", StreamingLLM), or those plus the heavy hitters up to kv_budget_tokens in all
    ("h2o")."""

    kv_eviction: str
    kv_sink_tokens: int
    kv_recent_tokens: int
    kv_budget_tokens: int

    def __post_init__(self) -> None:
        _check_choice("kv_eviction", self.kv_eviction, KV_EVICTION_POLICIES)
        for name in ("kv_sink_tokens", "kv_recent_tokens", "kv_budget_tokens"):
            _check_non_negative_int(name, getattr(self, name))
        if self.kv_eviction != "none" and self.kv_recent_tokens < 1:
            raise ValueError(f"kv_recent_tokens must be at least 1 with kv_eviction={self.kv_eviction!r}")

    def check_budget(self, block_size: int) -> None:
        """H2O's budget, counted in blocks of `block_size`, must leave a block for heavy hitters beside the sinks
        and the recent window."""
        if self.kv_eviction in HEAD_STREAM_POLICIES:
            kept = self.kv_sink_tokens + self.kv_recent_tokens + block_size
            if self.kv_budget_tokens <= kept:
                raise ValueError(
                    f"kv_budget_tokens={self.kv_budget_tokens} leaves no room to choose: every head keeps the "
                    f"sinks, the recent window and the block being filled ({kept} tokens); give more than {kept} "
                    "tokens or lower kv_recent_tokens")
            return
        if self.kv_eviction != "h2o":
            return
        blocks = lambda tokens: -(-tokens // block_size)  # noqa: E731
        needed = blocks(self.kv_sink_tokens) + blocks(self.kv_recent_tokens) + 1
        if blocks(self.kv_budget_tokens) < needed:
            raise ValueError(
                f"kv_budget_tokens={self.kv_budget_tokens} leaves no room for heavy hitters: the sinks and the "
                f"recent window take {needed - 1} blocks of {block_size}; give at least {needed * block_size} tokens")


@dataclass(frozen=True)
class TierConfig:
    """The disk tier: a directory where full prefix blocks are kept too (None: off; docs/prefix_caching.md), and its
    cap, least recently used records removed first."""

    kv_disk_cache: str | None
    kv_disk_cache_size: int | str

    def __post_init__(self) -> None:
        if self.kv_disk_cache is None:
            return
        if not isinstance(self.kv_disk_cache, (str, os.PathLike)) or not str(self.kv_disk_cache).strip():
            raise ValueError(f"kv_disk_cache must be a directory path, got {self.kv_disk_cache!r}")
        parse_size(self.kv_disk_cache_size)

    @property
    def kv_disk_cache_size_bytes(self) -> int:
        return parse_size(self.kv_disk_cache_size)


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for, as the flat keyword arguments of LLM(...) and the CLI's flags. `None` means: take it
    from the model (max_model_len) or a documented default. __post_init__ builds the groups once, each validating its
    own fields: `cache` (CacheConfig), `scheduler` (SchedulerConfig), `compile` (CompileConfig), `eviction`
    (EvictionConfig), `tier` (TierConfig); they are attributes, not fields, so dataclasses.asdict(config) stays the
    keyword arguments."""

    model: str | None = None
    dtype: str = "float32"
    quantization: str = "none"  # "int8": int8 weights, int8 activations per token (kvserve/model/linear.py)
    kv_cache_dtype: str = "auto"  # cache
    block_size: int = DEFAULT_BLOCK_SIZE  # cache
    kv_cache_memory: int | str | None = None  # cache
    max_model_len: int | None = None  # scheduler
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # scheduler
    max_num_batched_tokens: int = 2048  # scheduler
    enable_prefix_caching: bool = True  # cache
    kv_eviction: str = "none"  # eviction: "none", "streaming" (StreamingLLM) or "h2o"
    kv_sink_tokens: int = 4  # eviction, streaming/h2o: the first tokens, always kept ("attention sinks")
    kv_recent_tokens: int = 1024  # eviction, streaming/h2o: the window of last tokens always kept
    kv_budget_tokens: int = 2048  # eviction, h2o: tokens kept in all (sinks + heavy hitters + recent)
    seed: int = 0
    device: str = "cpu"
    enforce_eager: bool = False  # compile
    compile_decode: bool | None = None  # compile: None = compiled where supported (CompileConfig)
    compile_gemms: bool = False  # compile
    batch_invariant: bool = False  # compile
    kv_disk_cache: str | None = None  # tier
    kv_disk_cache_size: int | str = "20GiB"  # tier
    # speculative decoding (kvserve/engine/speculative.py): a SpeculativeConfig, its dict, or its JSON text
    speculative_config: SpeculativeConfig | dict | str | None = None

    if TYPE_CHECKING:  # set once by __post_init__
        cache: CacheConfig
        scheduler: SchedulerConfig
        compile: CompileConfig
        eviction: EvictionConfig
        tier: TierConfig

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        canonical_dtype(self.dtype)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "compile": CompileConfig,
                  "eviction": EvictionConfig, "tier": TierConfig}
        for name, group in groups.items():
            values = {field.name: getattr(self, field.name) for field in dataclasses.fields(group)}
            object.__setattr__(self, name, group(**values))
        self._check_across_groups()

    def _check_across_groups(self) -> None:
        """What one group's values rule out in another's."""
        if self.batch_invariant and str(self.device).partition(":")[0] != "cpu":
            # tests/engine/test_cuda.py: on an H200 (torch 2.11) a 16-token prompt's logits came out 2.5e-6 apart
            # alone and batched, with the tile calls' attention on the math route too (docs/architecture.md)
            raise ValueError(f"batch_invariant=True is guaranteed on a CPU only; device={self.device!r} computes "
                             "a row differently by its place in a batch (measured on CUDA); use device='cpu'")
        if self.batch_invariant and self.kv_eviction != "none":
            raise ValueError(f"batch_invariant=True does not cover kv_eviction={self.kv_eviction!r}: its scored "
                             "attention and dropped blocks depend on the step; use kv_eviction='none'")
        if self.speculative_config is not None and self.kv_eviction == "h2o":
            raise ValueError("speculative_config does not combine with kv_eviction='h2o': its scores add up the "
                             "attention every computed token paid, rejected draft tokens' too; use StreamingLLM "
                             "('streaming'), a per-head policy or kv_eviction='none'")
        self.eviction.check_budget(self.block_size)
        if self.kv_disk_cache is not None and not self.enable_prefix_caching:
            raise ValueError("kv_disk_cache keeps prefix-cache blocks: it needs enable_prefix_caching=True")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def kv_cache_format(self) -> str:
        """The KV storage format's canonical name: "auto" is the model's dtype; fp8 is fp8_e4m3."""
        name = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(
            self.kv_cache_dtype, self.kv_cache_dtype)
        return DTYPE_ALIASES.get(self.dtype, self.dtype) if name == "auto" else name

    @property
    def kv_disk_cache_size_bytes(self) -> int:
        return self.tier.kv_disk_cache_size_bytes

    @property
    def kv_cache_memory_bytes(self) -> int:
        return self.cache.kv_cache_memory_bytes
