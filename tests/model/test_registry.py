"""Every architecture kvserve accepts has a decoder, and each tiny model gets its own family's."""
import json

import pytest
import torch

from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvserve.model.gemma3 import Gemma3Model
from kvserve.model.float_kernels import BLAS
from kvserve.model.linear import WeightsPolicy
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_weights
from kvserve.model.registry import MODEL_CLASSES, build_model
from tests.conftest import make_tiny_model


def test_every_supported_architecture_has_a_decoder():
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES.values())


@pytest.mark.parametrize("kind, model_class", [("llama-gqa", LlamaModel), ("qwen3-gqa", LlamaModel),
                                               ("gemma3-mqa", Gemma3Model)])
def test_build_model_picks_the_family_decoder(tmp_path, kind, model_class):
    path = make_tiny_model(tmp_path, kind)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert type(build_model(cfg, load_weights(path), max_positions=64)) is model_class


def test_the_weights_policy_reaches_the_linears(tmp_path):
    path = make_tiny_model(tmp_path, "llama-gqa")
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    policy = WeightsPolicy(torch.bfloat16, "cpu", batch_invariant=True)
    model = build_model(cfg, load_weights(path), 64, policy)
    assert model.linears.policy is policy and model.linears.matmul is BLAS
    assert model.layers[0].qkv.dtype == model.rotary.lookup(torch.tensor([0]))[0].dtype == torch.bfloat16
