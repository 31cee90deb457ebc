"""Which decoder runs which architecture family (ModelConfig.architecture): one file per family."""
from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.deepseek import DeepseekModel
from kvserve.model.gemma3 import Gemma3Model
from kvserve.model.linear import WeightsPolicy
from kvserve.model.llama import LlamaModel
from kvserve.model.qwen3_next import Qwen3NextModel

MODEL_CLASSES: dict[str, type] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gemma3_text": Gemma3Model,
    "deepseek_v2": DeepseekModel,
    "deepseek_v3": DeepseekModel,
    "qwen3_next": Qwen3NextModel,
    "qwen3_5_text": Qwen3NextModel,
}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                policy: WeightsPolicy = WeightsPolicy()) -> LlamaModel | Gemma3Model | DeepseekModel | Qwen3NextModel:
    """The decoder for `cfg.architecture`, holding `weights` as `policy` says (kvserve/model/linear.py)."""
    return MODEL_CLASSES[cfg.architecture](cfg, weights, max_positions, policy)
