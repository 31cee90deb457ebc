"""kvserve's configurations in `kvserve bench throughput`: one row per combination of the options' values (dtype x
weights x KV format x block size x modes), each checked by the engine's own config before anything loads."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from kvserve.config import DEFAULT_BLOCK_SIZE, DEFAULT_DISABLE_BY_BATCH_SIZE, CompileConfig, EngineConfig

SPECULATIVE_METHODS = ("off", "ngram", "suffix")
COMPILE_MODES = {"default": None, "off": False, "on": True, "gemms": True}  # --compile-decode's values


@dataclass(frozen=True)
class KvserveConfig:
    dtype: str
    quantization: str
    kv_cache_dtype: str
    batch_invariant: bool = False
    speculative: str = "off"
    num_speculative_tokens: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    compile_decode: bool | None = None  # None: the engine's default (compiled unless KVSERVE_EAGER_STEPS=1)
    compile_gemms: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_eviction: str = "none"  # with its budget and recent window (--kv-budget-tokens, --kv-recent-tokens)
    kv_budget_tokens: int = 0
    kv_recent_tokens: int = 0

    @property
    def name(self) -> str:
        extras = ([f"{self.quantization} weights"] if self.quantization != "none" else []) + \
            ([f"KV {self.kv_cache_dtype}"] if self.kv_cache_dtype != "auto" else []) + \
            ([f"blocks of {self.block_size}"] if self.block_size != DEFAULT_BLOCK_SIZE else []) + \
            ([f"{self.kv_eviction} budget {self.kv_budget_tokens}"] if self.kv_eviction != "none" else []) + \
            (["batch-invariant"] if self.batch_invariant else []) + \
            ([f"{self.speculative} k={self.num_speculative_tokens}"] if self.speculative != "off" else []) + \
            ([f"off above {self.disable_by_batch_size}"] if self.disable_by_batch_size != DEFAULT_DISABLE_BY_BATCH_SIZE
             and self.speculative != "off" else []) + \
            (["compiled decode"] if self.compiled else []) + (["compiled GEMMs"] if self.compile_gemms else [])
        return f"kvserve ({', '.join([self.dtype, *extras])})"

    @property
    def compiled(self) -> bool:
        """Whether its decode steps are to run compiled (the engine may still run them eagerly and say why)."""
        return CompileConfig(False, self.compile_decode, self.compile_gemms, self.batch_invariant).decode_steps

    def ran_as(self, compiled: bool, state_update_compiled: bool = False) -> str:
        """The row's name once its engine is built: the default mode named by what the engine did (an engine whose
        model no graph supports runs eagerly, and says why at start; a hybrid model's then compiles its states'
        decode update alone, kv/state_cache.py)."""
        if state_update_compiled and not compiled:
            return f"{replace(self, compile_decode=False).name[:-1]}, compiled state update)"
        return replace(self, compile_decode=compiled).name if self.compile_decode is None else self.name

    @property
    def eviction(self) -> dict:
        """The LLM's eviction options (none: the engine's defaults)."""
        if self.kv_eviction == "none":
            return {}
        return {"kv_eviction": self.kv_eviction, "kv_budget_tokens": self.kv_budget_tokens,
                "kv_recent_tokens": self.kv_recent_tokens}

    @property
    def speculative_config(self) -> dict | None:
        if self.speculative == "off":
            return None
        return {"method": self.speculative, "num_speculative_tokens": self.num_speculative_tokens,
                "disable_by_batch_size": self.disable_by_batch_size}


def option_values(values: list[str]) -> list[str]:
    """Space- or comma-separated option values ("auto,int8" or "auto int8")."""
    return [v for value in values for v in value.split(",") if v]


def kvserve_configs(args: argparse.Namespace) -> list[KvserveConfig]:
    """Every combination of the options' values, in row order; a bad value exits naming the choices."""
    modes, compile_modes, methods = _checked_modes(args)
    configs = [KvserveConfig(d, q, kv, mode == "on", method, args.num_speculative_tokens, limit,
                             COMPILE_MODES[compiled], compiled == "gemms", block, eviction,
                             args.kv_budget_tokens, args.kv_recent_tokens)
               for d in args.dtypes for q in option_values(args.quantization)
               for kv in option_values(args.kv_cache_dtype)
               for block in dict.fromkeys(args.block_size) for mode in modes for method in methods
               for limit in (args.disable_by_batch_size if method != "off" else [DEFAULT_DISABLE_BY_BATCH_SIZE])
               for compiled in compile_modes for eviction in option_values(args.kv_eviction)]
    for c in configs:
        _check_with_engine_config(c)
    return configs


def _checked_modes(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """The --batch-invariant, --compile-decode and --speculative values, each checked against its choices."""
    modes = option_values(args.batch_invariant)
    if set(modes) - {"off", "on"}:
        raise SystemExit(f"kvserve bench throughput: --batch-invariant takes off and/or on, got {args.batch_invariant}")
    compile_modes = option_values(args.compile_decode)
    if not compile_modes or set(compile_modes) - set(COMPILE_MODES):
        raise SystemExit(f"kvserve bench throughput: --compile-decode takes default, off, on and/or gemms, got "
                         f"{args.compile_decode}")
    methods = option_values(args.speculative)
    if set(methods) - set(SPECULATIVE_METHODS):
        raise SystemExit(f"kvserve bench throughput: --speculative takes {', '.join(SPECULATIVE_METHODS)}, got "
                         f"{args.speculative}")
    return modes, compile_modes, methods


def _check_with_engine_config(config: KvserveConfig) -> None:
    """Bad values fail here, naming the choices, before anything loads."""
    try:
        EngineConfig(dtype=config.dtype, quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
                     speculative_config=config.speculative_config, block_size=config.block_size, **config.eviction)
    except ValueError as exc:
        raise SystemExit(f"kvserve bench throughput: {exc}") from exc
