"""Parameters of a decoder-only model, estimated from its config.json (dense or MoE, GQA or MLA)."""
from __future__ import annotations


def estimate_num_parameters(config: dict) -> int | None:
    """Parameters of a decoder-only model with gated MLPs (dense or MoE, GQA or MLA); None when unknowable.

    Linear-attention layers come in too many shapes to count from a config, so hybrid models need an
    explicit num_parameters.
    """
    if config.get("full_attention_interval") or "linear_attention" in (config.get("layer_types") or []):
        return None
    try:
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
        num_layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    per_layer_norms = hidden * (4 if str(config.get("model_type", "")).startswith("gemma") else 2)
    layers = sum(_attention_params(config) + _mlp_params(config, i) + per_layer_norms for i in range(num_layers))
    return embeddings + layers + hidden  # + the final norm


def _attention_params(config: dict) -> int:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    if config.get("kv_lora_rank"):
        return _mla_params(config, hidden, heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    params = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if config.get("model_type") == "qwen2":  # Qwen2 always biases q, k and v
        params += q_out + 2 * kv_out
    elif config.get("attention_bias"):
        params += q_out + 2 * kv_out + hidden
    if str(config.get("model_type", "")).startswith(("qwen3", "gemma3")):  # per-head RMSNorm on q and k
        params += 2 * head_dim
    return params


def _mla_params(config: dict, hidden: int, heads: int) -> int:
    """DeepSeek V2/V3 attention: low-rank q (optional) and kv projections around the cached latent."""
    rope, nope = int(config["qk_rope_head_dim"]), int(config["qk_nope_head_dim"])
    v_dim, kv_rank = int(config["v_head_dim"]), int(config["kv_lora_rank"])
    q_rank = config.get("q_lora_rank")
    q = hidden * heads * (nope + rope) if not q_rank else hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
    kv = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _mlp_params(config: dict, layer: int) -> int:
    """Gated MLP (gate, up, down); MoE layers hold every expert, the shared ones and the router."""
    hidden = int(config["hidden_size"])
    experts = config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
    if not experts or layer < int(config.get("first_k_dense_replace") or 0):
        return 3 * hidden * int(config["intermediate_size"])
    expert_size = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    shared_size = int(config.get("shared_expert_intermediate_size") or 0)
    shared_size += int(config.get("n_shared_experts") or 0) * expert_size
    return 3 * hidden * (int(experts) * expert_size + shared_size) + hidden * int(experts)
