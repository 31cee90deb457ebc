"""DeepSeek-V2/V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) as plain tensor code over a flat batch.

Multi-head Latent Attention (MLA): a token's keys and values for every head are expanded from one small latent
(kv_lora_rank values, RMS-normalized) by the up-projection kv_b = [W_UK; W_UV] per head, and each head's key ends in
a RoPE part that all heads share (qk_rope_head_dim values). The cache holds just those two, one vector per token
and layer (kv/formats/latent.py). Attention reads it two ways:
- expanded: kv_b turns the gathered latents into per-head keys and values, then ordinary attention. Its cost is
  per key, shared by all of a request's queries: the way for prefill.
- absorbed: W_UK moves into the query (q_nope W_UK is a query in latent space) and W_UV into the output, so all
  heads attend over the cached vectors themselves as one shared key head (values: its latent part). Its cost is
  per query: the way for decode, which reads the cache once and never expands it.
`attention_mode` "auto" takes whichever needs fewer multiply-adds for the group's queries per request
(`absorbed_max_queries`): decode and short chunks absorbed, long prefills expanded (docs/benchmarks.md measures
both ways on both sides of the crossover). StreamingLLM's sink keys are scored absorbed and written out;
--batch-invariant absorbs every position over its own tile's keys and runs every expert on every row of a tile.

The feed-forward is a dense MLP in the first layers and a mixture of experts after: routed experts chosen per token
(V2: softmax scores, greedy or group-limited; V3: sigmoid scores with a learned bias for the choice, top groups by
their two best experts) plus shared experts every token passes through."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kv.kv_cache import PagedKVCache
from kvserve.model.attention import AttentionGroup, AttentionMetadata
from kvserve.model.config import DeepseekConfig, ModelConfig
from kvserve.model.linear import Linears, WeightsPolicy, load_linears, weights_nbytes
from kvserve.model.rotary import RotaryEmbedding, yarn_mscale
from kvserve.rotation import apply_rotary

ATTENTION_MODES = ("auto", "absorbed", "expanded")


def halves_layout(weight: torch.Tensor, rope_dim: int, num_heads: int) -> torch.Tensor:
    """Rows (or entries) of each head's trailing RoPE part reordered from DeepSeek's interleaved pairs (x0, x1),
    (x2, x3), ... to the two halves rotate-half pairs: queries and keys reordered alike keep every dot product."""
    per_head = weight.view(num_heads, -1, *weight.shape[1:])
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    rope = per_head[:, -rope_dim:][:, order]
    return torch.cat([per_head[:, :-rope_dim], rope], dim=1).reshape(weight.shape)


def rope_factors(cfg: ModelConfig) -> tuple[float, float]:
    """(factor on cos/sin, factor on the softmax scale) of the config's YaRN scaling; (1, 1) without it."""
    s = cfg.rope_scaling
    if s is None:
        return 1.0, 1.0
    factor, mscale, mscale_all_dim = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if s.get("attention_factor") is not None:
        rope = s["attention_factor"]
    elif mscale and mscale_all_dim:
        rope = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        rope = yarn_mscale(factor)
    softmax = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return rope, softmax


def absorbed_max_queries(rank: int, nope: int, v_dim: int) -> int | float:
    """Queries per request up to which absorbed attention needs fewer multiply-adds than expanded. Per key and head,
    expanding costs rank x (nope + v) once for all queries; per query, key and head, absorbed attends over rank + rope
    and sums rank values, expanded nope + rope and v: Q (2 rank - nope - v) < rank (nope + v). The rope part and
    the per-query absorption (independent of the keys) drop out."""
    extra_per_query = 2 * rank - nope - v_dim
    return rank * (nope + v_dim) // extra_per_query if extra_per_query > 0 else float("inf")


class LatentAttention:
    """One layer's MLA: projections, the cached vector, and attention expanded or absorbed."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, linears: Linears, scale: float,
                 rope_attention_factor: float):
        ds: DeepseekConfig = cfg.deepseek
        a = f"{prefix}.self_attn"
        self.heads, self.nope, self.rope = cfg.num_heads, ds.qk_nope_head_dim, ds.qk_rope_head_dim
        self.rank, self.v_dim, self.scale, self.eps = ds.kv_lora_rank, ds.v_head_dim, scale, cfg.rms_norm_eps
        self.rope_attention_factor = rope_attention_factor  # YaRN's, in the cos/sin tables

        def rope_rows(name: str, heads: int) -> torch.Tensor | None:
            t = w.get(name)
            return halves_layout(t, self.rope, heads) if t is not None and ds.rope_interleave else t

        bias = lambda name: w.get(f"{a}.{name}.bias") if cfg.attention_bias else None  # noqa: E731
        if ds.q_lora_rank is None:
            self.q_a = self.q_a_norm = None
            self.q_b = linears.linear(rope_rows(f"{a}.q_proj.weight", self.heads))
        else:
            self.q_a = linears.linear(w[f"{a}.q_a_proj.weight"], bias("q_a_proj"))
            self.q_a_norm = w[f"{a}.q_a_layernorm.weight"]
            self.q_b = linears.linear(rope_rows(f"{a}.q_b_proj.weight", self.heads))
        self.kv_a = linears.linear(rope_rows(f"{a}.kv_a_proj_with_mqa.weight", 1),
                                   rope_rows(f"{a}.kv_a_proj_with_mqa.bias", 1) if cfg.attention_bias else None)
        self.kv_a_norm = w[f"{a}.kv_a_layernorm.weight"]
        # kv_b stays in the model dtype even with int8 weights: absorbed attention uses its per-head slices as
        # matrices, and both ways must compute the same function
        self.kv_b_weight = w[f"{a}.kv_b_proj.weight"]
        per_head = self.kv_b_weight.view(self.heads, self.nope + self.v_dim, self.rank)
        self.w_uk, self.w_uv = per_head[:, : self.nope], per_head[:, self.nope :]  # [H, nope, rank], [H, v, rank]
        self.o_proj = linears.linear(w[f"{a}.o_proj.weight"], bias("o_proj"))
        self.absorbed_max_queries = absorbed_max_queries(self.rank, self.nope, self.v_dim)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Normed hidden [T, hidden] -> q_nope [T, H, nope], rotated q_rope [T, H, rope] and the cached vector
        [T, 1, rank + rope] (normalized latent, then the rotated shared key)."""
        q = self.q_b(x if self.q_a is None else self._norm(self.q_a(x), self.q_a_norm))
        q_nope, q_rope = q.view(-1, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        cached = torch.cat([self._norm(latent, self.kv_a_norm)[:, None], apply_rotary(k_rope[:, None], cos, sin)], -1)
        return q_nope, apply_rotary(q_rope, cos, sin), cached

    def absorb_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[T, H, rank + rope]: each head's query in latent space (q_nope W_UK), then its rotated part."""
        return torch.cat([torch.einsum("thn,hnr->thr", q_nope, self.w_uk), q_rope], dim=-1)

    def absorb_output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention over latents [T, H, rank] -> per-head values [T, H, v] (W_UV applied after the sum)."""
        return torch.einsum("thr,hvr->thv", out, self.w_uv)

    def expand(self, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached vectors [..., 1, rank + rope] -> per-head keys [..., H, nope + rope] and values [..., H, v]."""
        kv = F.linear(cached[..., 0, : self.rank], self.kv_b_weight).unflatten(-1, (self.heads, -1))
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = cached[..., self.rank :].expand(*k_nope.shape[:-1], self.rope)
        return torch.cat([k_nope, k_rope], dim=-1), values

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def weight_parts(self) -> list:
        parts = [self.q_a, self.q_a_norm, self.q_b, self.kv_a, self.kv_a_norm, self.kv_b_weight, self.o_proj]
        return [p for p in parts if p is not None]


def latent_attention(attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor,
                     layer: int, cache: PagedKVCache, meta: AttentionMetadata, mode: str) -> torch.Tensor:
    """Write the step's cached vectors and attend every group; returns per-head values [T, H, v]."""
    cache.write(layer, cached, None)
    if meta.tile_calls is not None:
        return _tile_attention(attn, q_nope, q_rope, layer, cache, meta)
    out = q_nope.new_empty(q_nope.shape[0], attn.heads, attn.v_dim)
    for group in meta.groups[meta.layer_group[layer]]:
        queries = group.query_index.shape[1]
        absorbed = mode == "absorbed" or (mode == "auto" and queries <= attn.absorbed_max_queries)
        attend = _sink_scored if group.sink_rotation is not None else _absorbed if absorbed else _expanded
        rows = attend(attn, q_nope, q_rope, cached, layer, cache, group).reshape(-1, attn.heads, attn.v_dim)
        if group.out_rows is None and group.out_tokens is None:
            out = rows
        else:
            out[group.out_tokens] = rows[group.out_rows] if group.out_rows is not None else rows
    return out


def _keys_of(cached: torch.Tensor, layer: int, cache: PagedKVCache, group: AttentionGroup) -> torch.Tensor:
    """The group's cached vectors [S, keys, 1, rank + rope]: its own new tokens when fresh, else its blocks."""
    return cached[group.query_index] if group.fresh else cache.gather(layer, group.block_tables)[0]


def _expanded(attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor, layer: int,
              cache: PagedKVCache, group: AttentionGroup) -> torch.Tensor:
    keys, values = attn.expand(_keys_of(cached, layer, cache, group))  # [S, K, H, nope + rope], [S, K, H, v]
    queries = torch.cat([q_nope, q_rope], dim=-1)[group.query_index]  # [S, Q, H, nope + rope]
    # values zero-padded to the keys' width: with equal widths the CPU takes its flash kernel (measured 5x faster
    # on a 4,096-token prompt, and no [Q, K] score matrix per head); the padding's outputs are dropped
    values = F.pad(values, (0, keys.shape[-1] - values.shape[-1]))
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=group.mask, is_causal=group.mask is None, scale=attn.scale)
    return out.transpose(1, 2)[..., : attn.v_dim]  # [S, Q, H, v]


def _absorbed(attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor, layer: int,
              cache: PagedKVCache, group: AttentionGroup) -> torch.Tensor:
    S, Q = group.query_index.shape
    queries = attn.absorb_query(q_nope[group.query_index].flatten(0, 1), q_rope[group.query_index].flatten(0, 1))
    keys = _keys_of(cached, layer, cache, group).transpose(1, 2)  # [S, 1, K, rank + rope]: one head for all
    values = keys  # the latent part is the value; reading the rope part too keeps widths equal (the flash kernel)
    if Q == 1:  # decode: the heads are the one key head's query rows, under one mask row
        out = F.scaled_dot_product_attention(queries.view(S, 1, attn.heads, -1), keys, values, attn_mask=group.mask,
                                             scale=attn.scale)  # [S, 1, H, rank + rope]
    else:
        out = F.scaled_dot_product_attention(queries.view(S, Q, attn.heads, -1).transpose(1, 2), keys, values,
                                             attn_mask=group.mask, is_causal=group.mask is None, scale=attn.scale,
                                             enable_gqa=True).transpose(1, 2)  # [S, Q, H, rank + rope]
    return attn.absorb_output(out[..., : attn.rank].reshape(S * Q, attn.heads, attn.rank))


def _sink_scored(attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor,
                 layer: int, cache: PagedKVCache, group: AttentionGroup) -> torch.Tensor:
    """StreamingLLM, absorbed and written out: sink keys are scored with each query's RoPE part rotated back by the
    gap between the sinks and its window (attention_mask.py); only the rope part carries positions in MLA."""
    S, Q = group.query_index.shape
    latent_q = torch.einsum("sqhn,hnr->sqhr", q_nope[group.query_index], attn.w_uk)
    rope_q = q_rope[group.query_index]  # [S, Q, H, rope]
    keys = cache.gather(layer, group.block_tables)[0][:, :, 0]  # [S, K, rank + rope]
    logits = torch.einsum("sqhd,skd->shqk", torch.cat([latent_q, rope_q], -1), keys) * attn.scale
    cos, sin = group.sink_rotation  # from the rotary tables, which carry YaRN's factor: a rotation needs none
    factor = attn.rope_attention_factor
    back = apply_rotary(rope_q, cos / factor, sin / factor)
    num_sink = group.sink_keys.shape[1]
    sink_logits = torch.einsum("sqhd,skd->shqk", torch.cat([latent_q, back], -1), keys[:, :num_sink]) * attn.scale
    logits[..., :num_sink] = torch.where(group.sink_keys[:, None, None, :], sink_logits, logits[..., :num_sink])
    probs = logits.masked_fill(~group.mask, float("-inf")).softmax(dim=-1)
    out = torch.einsum("shqk,skr->sqhr", probs, keys[..., : attn.rank])
    return attn.absorb_output(out.reshape(S * Q, attn.heads, attn.rank))


def _tile_attention(attn: LatentAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, layer: int,
                    cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Batch-invariant mode: every position absorbed, over exactly its tile's keys, each (position, head) a
    one-row query of its own (model/attention.py's tile calls), so decode and prefill compute a position alike."""
    queries = meta.tiles.map(attn.absorb_query, q_nope, q_rope)  # [T, H, rank + rope]
    out = queries.new_empty(queries.shape[0], attn.heads, attn.rank)
    for call in meta.tile_calls[meta.layer_group[layer]]:
        keys = cache.gather(layer, call.block_tables)[0].transpose(1, 2)  # [S, 1, K, rank + rope]
        (S, P), num_keys = call.query_index.shape, keys.shape[2]
        rows = queries[call.query_index].view(S, P * attn.heads, 1, -1)
        mask = call.mask[:, :, None, None, :].expand(S, P, attn.heads, 1, num_keys).reshape(S, -1, 1, num_keys)
        result = F.scaled_dot_product_attention(rows, keys, keys[..., : attn.rank], attn_mask=mask, scale=attn.scale,
                                                enable_gqa=True)  # [S, P * H, 1, rank]
        out[call.query_index.reshape(-1)] = result.reshape(S * P, attn.heads, attn.rank)
    return meta.tiles.map(attn.absorb_output, out)


class MoE:
    """Routed experts (each token's top k by the router's scores, weighted) plus shared experts for every token."""

    def __init__(self, ds: DeepseekConfig, w: dict[str, torch.Tensor], prefix: str, linears: Linears):
        m = f"{prefix}.mlp"
        self.ds = ds
        # the router computes in float32, as the checkpoints keep it
        self.router = w[f"{m}.gate.weight"].float()
        self.choice_bias = w[f"{m}.gate.e_score_correction_bias"].float() if ds.scoring == "sigmoid" else None
        self.experts = [MLP(w, f"{m}.experts.{e}", linears) for e in range(ds.n_routed_experts)]
        self.shared = MLP(w, f"{m}.shared_experts", linears) if ds.n_shared_experts else None

    def __call__(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """x [T, hidden]. `dense` runs every expert on every row (batch-invariant mode: shapes fixed by the tile)."""
        weights, chosen = self.route(x)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        if dense:
            per_expert = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
            per_expert.scatter_(1, chosen, weights)
            for e, expert in enumerate(self.experts):
                out = out + expert(x) * per_expert[:, e : e + 1].to(x.dtype)
            return out
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype))
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's expert weights and expert ids, [T, k] each."""
        ds, k = self.ds, self.ds.num_experts_per_tok
        logits = F.linear(x.float(), self.router)
        scores = logits.sigmoid() if ds.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.choice_bias is None else scores + self.choice_bias
        if ds.topk_method in ("group_limited_greedy", "noaux_tc"):
            choice = self._best_groups_only(choice)
        chosen = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if ds.norm_topk_prob and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if ds.scoring == "sigmoid" or not ds.norm_topk_prob:  # V2 scales only weights it did not normalize
            weights = weights * ds.routed_scaling_factor
        return weights, chosen

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """Scores of experts outside the topk_group best groups masked out (V2: a group's best score ranks it;
        V3: the sum of its two best)."""
        ds = self.ds
        grouped = choice.view(choice.shape[0], ds.n_group, -1)
        group_scores = grouped.amax(dim=-1) if ds.scoring == "softmax" else grouped.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(ds.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        dropped = 0.0 if ds.scoring == "softmax" else float("-inf")
        return grouped.masked_fill(~keep[..., None], dropped).view_as(choice)

    def weight_parts(self) -> list:
        return [self.router, *(p for e in self.experts for p in e.weight_parts()),
                *(self.shared.weight_parts() if self.shared is not None else [])] + \
            ([self.choice_bias] if self.choice_bias is not None else [])


class MLP:
    """SwiGLU feed-forward: down(silu(gate x) * up x), gate and up fused."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, linears: Linears):
        gate = w[f"{prefix}.gate_proj.weight"]
        self.intermediate_size = gate.shape[0]
        self.gate_up = linears.linear(torch.cat([gate, w[f"{prefix}.up_proj.weight"]]))
        self.down = linears.linear(w[f"{prefix}.down_proj.weight"])

    def __call__(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """x [T, hidden]; `dense` is the MoE's flag, meaningless for one dense MLP."""
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down(F.silu(gate) * up)

    def weight_parts(self) -> list:
        return [self.gate_up, self.down]


class DeepseekDecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int, linears: Linears, scale: float,
                 rope_attention_factor: float):
        prefix = f"model.layers.{layer}"
        self.attn = LatentAttention(cfg, w, prefix, linears, scale, rope_attention_factor)
        self.mlp = MoE(cfg.deepseek, w, prefix, linears) if cfg.deepseek.is_moe_layer(layer) else \
            MLP(w, f"{prefix}.mlp", linears)
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_attention_norm = w[f"{prefix}.post_attention_layernorm.weight"]
        self.eps = cfg.rms_norm_eps

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache: PagedKVCache,
                meta: AttentionMetadata, mode: str) -> torch.Tensor:
        # per-token work runs as meta.tiles cuts it (batch-invariant mode: fixed tiles); attention sees the batch
        q_nope, q_rope, cached = meta.tiles.map(self._project, h, cos, sin)
        out = latent_attention(self.attn, q_nope, q_rope, cached, layer, cache, meta, mode)
        dense = bool(meta.tiles)
        return meta.tiles.map(lambda x, o: self._output_and_mlp(x, o, dense), h, out)

    def _project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.attn.project(self._norm(h, self.input_norm), cos, sin)

    def _output_and_mlp(self, h: torch.Tensor, attention: torch.Tensor, dense: bool) -> torch.Tensor:
        h = h + self.attn.o_proj(attention.flatten(1))
        return h + self.mlp(self._norm(h, self.post_attention_norm), dense)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def weight_parts(self) -> list:
        return [*self.attn.weight_parts(), *self.mlp.weight_parts(), self.input_norm, self.post_attention_norm]


class DeepseekModel:
    """Weights plus forward(); the KV cache it writes holds one latent + rope vector per token and layer."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 policy: WeightsPolicy = WeightsPolicy()):
        w, linears, self.lm_head, self.embed = load_linears(weights, cfg.tie_word_embeddings, policy)
        ds = cfg.deepseek
        self.cfg = cfg
        self.linears = linears
        self.attention_mode = "auto"  # or "absorbed" / "expanded" everywhere (tests, kvserve bench mla)
        rope_factor, softmax_factor = rope_factors(cfg)
        scale = (ds.qk_nope_head_dim + ds.qk_rope_head_dim) ** -0.5 * softmax_factor
        self.norm = w["model.norm.weight"]
        self.layers = [DeepseekDecoderLayer(cfg, w, i, linears, scale, rope_factor) for i in range(cfg.num_layers)]
        scaling = cfg.rope_scaling and {"original_max_position_embeddings": cfg.max_position_embeddings,
                                        **cfg.rope_scaling}
        self.rotary = RotaryEmbedding(ds.qk_rope_head_dim, max_positions, cfg.rope_theta, scaling, policy.dtype,
                                      policy.device,
                                      attention_factor=rope_factor)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] flat tokens of all requests. Returns final hidden states [T, hidden]."""
        if self.attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode {self.attention_mode!r}; choose one of {', '.join(ATTENTION_MODES)}")
        h = meta.tiles.map(self.embed, input_ids)
        cos, sin = self.rotary.lookup(meta.positions)
        for i, layer in enumerate(self.layers):
            h = layer.forward(h, cos, sin, i, cache, meta, self.attention_mode)
        return meta.tiles.map(self._final_norm, h)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, self.norm.shape, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight the model holds, in the form it computes with (tied tables counted once)."""
        parts = (p for layer in self.layers for p in layer.weight_parts())
        return weights_nbytes(self.embed, self.lm_head, self.norm, *parts)
