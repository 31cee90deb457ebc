"""kvserve: LLM inference and serving built around a paged, shared, measured KV cache."""
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.config import EngineConfig
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput"]
