"""Building an engine for per-(layer, KV head) streams (`--kv-eviction adakv`, `adakv-knorm`, `perhead`): what the
setting refuses by name, its storage (kv/head_streams.py: float, int8 with a scale per token, or int4 of rotated
vectors with a scale and zero point per token) sized from the
planner's pool, the manager's scorer and, for `headkv-span`, the model's retrieval-head weights
(engine/retrieval_heads.py)."""
from __future__ import annotations

import logging
from pathlib import Path

from kvserve.config import EngineConfig
from kvserve.engine.retrieval_heads import describe, head_weights, load_or_measure
from kvserve.kv.eviction import HEAD_POLICIES
from kvserve.kv.formats import FLOAT_FORMATS
from kvserve.kv.head_streams import HeadStreamKVCache, Int4HeadStreamKVCache, Int8HeadStreamKVCache
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.kv.scorers import make_scorer, window_queries
from kvserve.model.config import ModelConfig
from kvserve.model.embedded import default_cache_dir
from kvserve.planner.capacity import KVCachePlan
from kvserve.planner.layout import KVLayout

logger = logging.getLogger("kvserve")

QUANTIZED_STREAMS = {"int8": Int8HeadStreamKVCache, "int4": Int4HeadStreamKVCache}
HEAD_STREAM_FORMATS = (*FLOAT_FORMATS, *QUANTIZED_STREAMS)


def check_head_settings(config: EngineConfig) -> None:
    """What per-head streams do not run with yet, by name (batch invariance is refused for every eviction policy by
    EngineConfig)."""
    refused = {
        # only the float formats, int8 and int4 own a head-stream store and read
        "kv_cache_dtype": config.kv_cache_format not in HEAD_STREAM_FORMATS,
        "compile_decode": config.compile.asked,  # no compiled step reads head streams (by default: eager)
        "kv_disk_cache": config.kv_disk_cache is not None,  # nothing enters the prefix index to save
    }
    names = [name for name, on in refused.items() if on]
    if names:
        raise ValueError(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not supported with "
                         f"kv_eviction={config.kv_eviction!r} (per-head streams store float, int8 or int4 K/V and "
                         "are read eagerly): use kv_cache_dtype auto, float32, bfloat16, float16, int8 or int4 and "
                         "turn the others off")


def head_blocks(plan: KVCachePlan, layout: KVLayout, model_config: ModelConfig) -> int:
    """The pool in head blocks: each of the plan's blocks is block_size tokens of every layer and KV head."""
    return plan.num_blocks * len(layout.group_of) * model_config.num_kv_heads


def build_head_cache(config: EngineConfig, plan: KVCachePlan, layout: KVLayout,
                     model_config: ModelConfig) -> HeadStreamKVCache:
    args = (layout, head_blocks(plan, layout, model_config), plan.block_size, model_config.num_kv_heads,
            model_config.head_dim, config.torch_dtype, config.device)
    scorer = HEAD_POLICIES[config.kv_eviction][0]
    kwargs = dict(num_query_heads=model_config.num_heads, window_queries=window_queries(scorer))
    if config.kv_cache_format in QUANTIZED_STREAMS:
        return QUANTIZED_STREAMS[config.kv_cache_format](*args, **kwargs)
    return HeadStreamKVCache(*args, storage_dtype=FLOAT_FORMATS[config.kv_cache_format], **kwargs)


def attach_head_streams(kv: KVCacheManager, cache: HeadStreamKVCache, model, model_path: Path) -> None:
    """Hand the manager the storage it compresses, the scorer its policy names (with the model's RoPE) and, for a
    policy that weights heads by their retrieval scores, the weights (measured once per model and kept)."""
    rotary = model.rotary
    scorer = make_scorer(kv.eviction.scorer, rotary.inv_freq, rotary.attention_factor)
    weights = None
    if kv.eviction.retrieval_heads:
        scores, source = load_or_measure(model_path, cache.num_layers_total, cache.num_kv_heads, default_cache_dir())
        weights = head_weights(scores)
        logger.info(describe(scores, weights, source))
    kv.groups[0].attach(cache, scorer, weights)
