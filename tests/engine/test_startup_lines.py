"""The start-up lines, word for word, from made-up facts (no model is built): what the weights, the KV cache, batch
invariance, compiled attention and steps, and speculative decoding say at start."""
from kvserve.compile.steps import PendingGraphs
from kvserve.config import SpeculativeConfig
from kvserve.engine.startup import (CacheFacts, CompiledAttentionFacts, CompiledStepsFacts, WeightsFacts,
                                    batch_invariance_line, capacity_line, compiled_attention_line, compiled_steps_line,
                                    compiling_steps_line, eager_steps_line, gemms_not_applied_line, one_row_loop_line,
                                    speculation_line, weights_line)
from kvserve.planner.capacity import plan_kv_cache
from kvserve.planner.model_spec import ModelSpec

TINY = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 100,
        "max_position_embeddings": 512, "torch_dtype": "float32"}  # 1 KiB/token in fp32


def test_float_weights_name_their_dtype_and_any_copies_a_kernel_keeps():
    assert weights_line(WeightsFacts(135_500_000, "bfloat16", None)) == "weights: 135.5 MB bfloat16"
    copies = WeightsFacts(2_000_000, "float32", None, tied_copy_nbytes=100_000, dense_copy_nbytes=1_500_000,
                          matmul_name="oneDNN linear")
    assert weights_line(copies) == (
        "weights: 2.0 MB float32 (of which 0.1 MB is oneDNN linear's packed copy of the tied embedding table: lookups "
        "read the table, the output head its packed copy; 1.5 MB the dense weights kept beside oneDNN linear's packed "
        "copies for compiled decode: a single stream multiplies them in loops of their own)")


def test_int8_weights_name_their_scales_the_fallback_kernel_and_the_copies():
    plain = WeightsFacts(40_000_000, "float32", "int8", matmul_name="torch._int_mm")
    assert weights_line(plain) == ("weights: 40.0 MB int8 (per-output-channel scales, activations quantized per "
                                   "token, both rotated; norms in float32)")
    codes = WeightsFacts(40_000_000, "float32", "int8", dense_copy_nbytes=5_000_000, matmul_name="onednn.qlinear")
    assert weights_line(codes) == (
        "weights: 40.0 MB int8 (per-output-channel scales, activations quantized per token, both rotated; norms in "
        "float32); of which 5.0 MB the codes kept as they are beside onednn.qlinear's packed copies for compiled "
        "decode steps: the single stream's graph multiplies them in loops of its own")
    fallback = WeightsFacts(1_234_567_890, "bfloat16", "int8", fallback_kernel_reason="no VNNI",
                            tied_copy_nbytes=3_000_000)
    assert weights_line(fallback) == (
        "weights: 1,234.6 MB int8 (per-output-channel scales, activations quantized per token, both rotated; norms "
        "in bfloat16); the codes are held as float32 for the fallback kernel (no VNNI); of which 3.0 MB is the int8 "
        "kernel's own copy of the tied embedding table (lookups read the codes, the output head its packed copy)")


def test_capacity_line_is_the_planners_with_the_format_the_groups_and_any_staging():
    plan = plan_kv_cache(ModelSpec.from_hf_config(TINY), 10 * 16 * 1024, 16, "fp32", max_model_len=20)
    plain = CacheFacts(plan, "float32", None, 0, 8)
    assert capacity_line(plain) == ("KV cache (float32): 10 blocks × 16 tokens = 160 tokens, 0.00 GiB "
                                    "(1.0 KiB/token); maximum concurrency for 20 tokens per request: 5.00x")
    staged = CacheFacts(plan, "int4, keys per channel per block", "2 groups", 3 * 2**20 // 2, 8)
    assert capacity_line(staged) == (
        "KV cache (int4, keys per channel per block; 2 groups): 10 blocks × 16 tokens = 160 tokens, 0.00 GiB "
        "(1.0 KiB/token); maximum concurrency for 20 tokens per request: 5.00x; plus 1.5 MiB of full-precision "
        "staging for partly filled blocks (2 blocks for each of 8 sequences)")


def test_batch_invariance_line_says_which_guarantee_holds():
    assert batch_invariance_line(True, 32) == (
        "batch invariance: bitwise (--batch-invariant: every per-token op on tiles of 16 tokens, attention per "
        "32-token query tile); a request's logits do not depend on its batch, chunking, prefix hits or preemption")
    assert batch_invariance_line(False, 32) == (
        "batch invariance: same greedy tokens batched or alone up to float rounding (a lossy KV format may flip a "
        "near-tie); --batch-invariant makes logits bitwise independent of the batch")
    assert batch_invariance_line(False, 32, "h2o") == (
        "batch invariance: none under h2o eviction: it decides what to keep between prompt chunks, from what the "
        "chunks so far attended to, so how a prompt is chunked (by the batch beside it, the token budget, a "
        "preemption) moves what it keeps and the tokens; StreamingLLM's window and no eviction do not depend on it")


def test_compiled_attention_and_steps_lines():
    assert compiled_attention_line(CompiledAttentionFacts("int8", 12.34)) == (
        "int8 decode attention compiled in 12.3 s (torch.compile; --enforce-eager skips it)")
    assert compiled_attention_line(CompiledAttentionFacts("int8", 0.42, 2)) == (
        "int8 decode attention compiled in 0.4 s (2 graphs loaded, torch.compile; --enforce-eager skips it)")
    assert compiled_attention_line(CompiledAttentionFacts("nuq3", 9.0, 1, 1)) == (
        "nuq3 decode attention compiled in 9.0 s (1 graph loaded, 1 graph compiled, torch.compile; --enforce-eager "
        "skips it)")
    kernels = ("decode attention", "block store")
    assert compiled_attention_line(CompiledAttentionFacts("nuq4", 2.0, 0, 3, kernels)) == (
        "nuq4 decode attention and block store compiled in 2.0 s (3 graphs compiled, torch.compile; --enforce-eager "
        "skips it)")
    assert eager_steps_line("h2o scores attention") == "decode steps: eager (h2o scores attention)"
    assert gemms_not_applied_line("int8 weights") == (
        "--compile-gemms: not applied (int8 weights); the decode step compiles without it")
    whole = CompiledStepsFacts(None, 64 * 2**20, 3.04, " (2 graphs compiled)", "")
    assert compiled_steps_line(whole) == (
        "decode steps: compiled (torch.compile; --enforce-eager turns it off): one sequence in a whole graph, several "
        "in another while their K/V padded to the longest is at most 64 MiB, the others (any number, any context lengths) in one "
        "with attention outside it, in 3.0 s (2 graphs compiled); prefill and mixed steps in the graph with attention "
        "outside it too")
    outside = CompiledStepsFacts("int4 blocks are gathered", 64 * 2**20, 1.0, "", ", weights frozen")
    assert compiled_steps_line(outside) == (
        "decode steps: one compiled graph with attention outside it (torch.compile, --enforce-eager turns it off; int4 "
        "blocks are gathered), in 1.0 s, weights frozen; prefill and mixed steps in the graph with attention outside it too")


def test_compiling_line_says_what_it_loads_compiles_and_how_long_before_it_starts():
    assert compiling_steps_line(PendingGraphs(4, 0, True, 12.0)) == (
        "decode steps: loading 4 saved compiled graphs (--enforce-eager skips compiling)")
    assert compiling_steps_line(PendingGraphs(0, 4, True, 21.4)) == (
        "decode steps: compiling 4 graphs now (the last compile of this engine on this machine took 21 s; later "
        "starts load them; nothing compiles while serving; --enforce-eager skips this)")
    first = compiling_steps_line(PendingGraphs(1, 2, False, None))
    assert first.startswith("decode steps: compiling 2 graphs now, loading 1 saved (none compiled for this engine "
                            "on this machine before: expect tens of seconds")
    assert "every start compiles them" in first


def test_speculation_line_names_the_method_and_its_bounds():
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=5,
                              disable_by_batch_size=8)
    assert speculation_line(ngram) == (
        "speculative decoding: ngram, up to 3 draft tokens (prompt lookup of 1..5-grams), while at most 8 sequences "
        "decode in a step (disable_by_batch_size)")
    suffix = SpeculativeConfig(method="suffix", num_speculative_tokens=6, suffix_decoding_max_tree_depth=12,
                               suffix_decoding_max_cached_requests=50, disable_by_batch_size=4)
    assert speculation_line(suffix) == (
        "speculative decoding: suffix, up to 6 draft tokens (suffix match up to 12 tokens over the request and the "
        "last 50 outputs), while at most 4 sequences decode in a step (disable_by_batch_size)")


def test_the_one_row_loop_line_says_how_it_was_got_or_why_it_is_not_used():
    class Loop:
        failed = None

        class compiled:
            graphs_loaded, graphs_compiled = 0, 1

    assert one_row_loop_line(2.84, Loop()) == (
        "one-row products (eager steps): the compiled graphs' float32 loop over the dense weights, compiled in 2.8 s "
        "(1 graph compiled, torch.compile; --enforce-eager skips it)")
    Loop.failed = "no C++ compiler"
    assert one_row_loop_line(0.1, Loop()) == ("one-row products: the weights' matmul route (compiling their loop "
                                              "failed: no C++ compiler)")
