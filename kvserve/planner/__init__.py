"""Capacity planner: KV bytes per token, per-request size, GPU capacity and multi-turn cost.

The engine sizes its KV block pool with `plan_kv_cache`, so `kvserve plan` and the engine agree.
"""
from kvserve.planner.capacity import KVCachePlan, MemoryBudget, plan_kv_cache
from kvserve.planner.loaders import load_model_spec
from kvserve.planner.model_spec import ModelSpec

__all__ = ["KVCachePlan", "MemoryBudget", "ModelSpec", "load_model_spec", "plan_kv_cache"]
