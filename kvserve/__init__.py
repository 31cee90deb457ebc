"""kvserve: LLM inference and serving built around a paged, shared, measured KV cache."""
from __future__ import annotations

import importlib

# The one place the version is written: pyproject.toml reads it from here (setuptools' attr:), and `kvserve
# --version`, the server's /version and its start-up log line print it. CHANGELOG.md says what each one added.
__version__ = "0.3.0.dev0"

# Public name -> module defining it. Loaded on first use, so that `kvserve --help` and `kvserve plan` never
# pay for importing torch.
_EXPORTS = {
    "LLM": "kvserve.engine.llm",
    "LLMEngine": "kvserve.engine.llm_engine",
    "EngineConfig": "kvserve.config",
    "SamplingParams": "kvserve.sampling_params",
    "BeamSearchParams": "kvserve.sampling_params",
    "RequestOutput": "kvserve.outputs",
    "CompletionOutput": "kvserve.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
