"""Which decoder runs which architecture family (ModelConfig.architecture): one file per family."""
from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.deepseek import DeepseekModel
from kvserve.model.gemma3 import Gemma3Model
from kvserve.model.llama import LlamaModel

MODEL_CLASSES: dict[str, type] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gemma3_text": Gemma3Model,
    "deepseek_v2": DeepseekModel,
    "deepseek_v3": DeepseekModel,
}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                quantization: str = "none", batch_invariant: bool = False,
                dense_in_graph: bool = False) -> LlamaModel | Gemma3Model | DeepseekModel:
    """The decoder for `cfg.architecture`, holding `weights` cast to `dtype` on `device` (int8 where
    `quantization` says so: kvserve/model/linear.py; float weights multiplied by the BLAS call where
    `batch_invariant`, by the start-up probe's choice otherwise: kvserve/model/float_kernels.py). `dense_in_graph`:
    float weights that a packed route multiplies are kept dense too, for a compiled graph's one-row loops (Linears)."""
    return MODEL_CLASSES[cfg.architecture](cfg, weights, max_positions, dtype, device, quantization, batch_invariant,
                                           dense_in_graph)
