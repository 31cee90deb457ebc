"""`kvserve bench mla`: Multi-head Latent Attention's cache and its two attention paths, on a random-weight
DeepSeek-V2-shaped model scaled so decode is memory-bound (no MLA checkpoint small enough is on the package index).

Printed in one run: KV bytes per token and tokens per GiB of the latent cache against the same model's per-head
K and V cached expanded (the planner's figures, which the engine allocates); then, at each --contexts length,
decode tokens/s of --batch requests with attention absorbed (over the latents) and expanded (the latents
up-projected to per-head K/V every step); then prefill tokens/s of one --prefill-tokens prompt both ways, in chunks
of each --prefill-chunks size, beside the way "auto" takes for it. The decode steps of both ways start from the
same prefilled blocks (the second finds them in the prefix cache)."""
from __future__ import annotations

import argparse
import time

# hidden 1,024, 16 heads, latent 256 + rope 32: DeepSeek-V2-Lite's proportions at a size that decodes on a CPU
BENCH_CONFIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                    kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8,
                    n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                    max_position_embeddings=32768, bos_token_id=1, eos_token_id=2)
MODES = ("absorbed", "expanded")


def add_mla_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("mla", help="MLA: latent vs expanded KV bytes, absorbed vs expanded attention")
    p.add_argument("--contexts", default="1024,4096",
                   help="decode context lengths, comma-separated (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="requests decoding at once (default %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per point (default %(default)s)")
    p.add_argument("--prefill-tokens", type=int, default=1024,
                   help="prompt of the prefill timing (default %(default)s)")
    p.add_argument("--prefill-chunks", default="16,64,256,1024",
                   help="prefill chunk sizes (tokens a step), comma-separated (default %(default)s)")
    p.add_argument("--model", default=None, help="an MLA model directory (default: the random model above, built "
                                                 "in a temporary directory)")
    p.set_defaults(func=run_mla)


def build_bench_model(directory) -> None:
    """Save the random DeepSeek-V2-shaped bench model (seed 0) as an HF directory."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**BENCH_CONFIG)).save_pretrained(directory)


def run_mla(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from pathlib import Path

    from rich.console import Console

    from kvserve.planner.kv_size import expanded_kv_bytes_per_token
    from kvserve.planner.model_spec import ModelSpec

    console = Console()
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-mla-") as tmp:
        model = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            build_bench_model(model)
        llm = _llm(model, max(contexts + [args.prefill_tokens]) + args.steps + 1, args.batch)
        plan = llm.engine.cache_plan
        spec = ModelSpec.from_hf_config(json.loads((model / "config.json").read_text()))
        expanded = expanded_kv_bytes_per_token(spec, plan.kv_dtype, plan.block_size)
        console.print(f"{spec.name if args.model else 'random DeepSeek-V2-shaped model'}: {spec.num_layers} layers, "
                      f"{spec.num_attention_heads} heads, hidden {spec.hidden_size:,}; {plan.kv_dtype.name}")
        for name, per_token in (("latent (kvserve)", plan.kv_bytes_per_token), ("expanded per-head K/V", expanded)):
            console.print(f"  {name}: {per_token:,} B/token, {2**30 // per_token:,} tokens per GiB", highlight=False,
                          soft_wrap=True)
        console.print(f"  the latent holds {expanded / plan.kv_bytes_per_token:.1f}x the tokens", highlight=False,
                      soft_wrap=True)
        for context in contexts:
            rates = {mode: _decode_rate(llm, context, args.batch, args.steps, mode) for mode in MODES}
            console.print(f"decode, {args.batch} x {context:,}-token context: absorbed {rates['absorbed']:.1f} "
                          f"tokens/s, expanded {rates['expanded']:.1f} tokens/s "
                          f"({rates['absorbed'] / rates['expanded']:.2f}x)", highlight=False, soft_wrap=True)
        limit = llm.engine.model.layers[0].attn.absorbed_max_queries
        for chunk in [int(c) for c in args.prefill_chunks.split(",")]:
            chunked = _llm(model, args.prefill_tokens + 1, 1, max_num_batched_tokens=chunk)
            rates = {mode: _prefill_rate(chunked, args.prefill_tokens, mode) for mode in MODES}
            console.print(f"prefill, one {args.prefill_tokens:,}-token prompt in chunks of {chunk:,}: absorbed "
                          f"{rates['absorbed']:,.0f} tokens/s, expanded {rates['expanded']:,.0f} tokens/s "
                          f"({rates['absorbed'] / rates['expanded']:.2f}x); auto: "
                          f"{'absorbed' if chunk <= limit else 'expanded'}", highlight=False, soft_wrap=True)
        console.print(f"auto absorbs groups of up to {limit} queries per request (fewer multiply-adds)",
                      highlight=False, soft_wrap=True)
    return 0


def _llm(model, max_model_len: int, batch: int, max_num_batched_tokens: int | None = None):
    from kvserve.engine.llm import LLM

    return LLM(str(model), max_model_len=max_model_len, max_num_seqs=batch,
               max_num_batched_tokens=max_num_batched_tokens or max_model_len,
               kv_cache_memory=f"{(batch + 1) * max_model_len * 5 // 1024 + 64}MiB")


def _prompts(engine, count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, engine.model_config.vocab_size, (length,), generator=g).tolist() for _ in range(count)]


def _decode_rate(llm, context: int, batch: int, steps: int, mode: str) -> float:
    """Decode tokens/s of `batch` requests at `context` tokens until each has `steps` + 1 tokens; the prefill (auto
    mode) is not timed."""
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(engine, batch, context, seed=context)):
        engine.add_request(f"{mode}-{context}-{i}", prompt, params)
    while _prefilling(engine):
        engine.step()
    engine.model.attention_mode, decoded = mode, engine.num_decode_tokens
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - started
    engine.model.attention_mode = "auto"
    return (engine.num_decode_tokens - decoded) / elapsed


def _prefilling(engine) -> bool:
    """Whether some request has not sampled its first token yet."""
    return any(seq.num_output_tokens == 0 for r in engine.requests.values() for seq in r.sequences)


def _prefill_rate(llm, tokens: int, mode: str) -> float:
    from kvserve.sampling_params import SamplingParams

    engine = llm.engine
    engine.reset_prefix_cache()
    engine.model.attention_mode = mode
    started = time.perf_counter()
    llm.generate(_prompts(engine, 1, tokens, seed=1)[0], SamplingParams(max_tokens=1))
    elapsed = time.perf_counter() - started
    engine.model.attention_mode = "auto"
    return tokens / elapsed
