"""The compiled decode step (kvserve/compile/steps.py): decode steps run as one graph and give eager's
tokens (except at a near-tie, which rounding may break either way) and logprobs within a float32 tolerance (the
graph fuses norms, RoPE and activations, which rounds a few ulps differently on every CPU, and multiplies one row by
float weights in loops of its own, whose sums are added in another order; attention is the same kernel); batch
sizes and context lengths the warm-up never saw run the same graph (no recompilation); steps the graph does not
cover run eagerly and the start-up line says why; a graph that fails falls back to eager, with one warning, and
serving goes on."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from kvserve import saved_graphs
from kvserve.compile import steps as compiled_step
from kvserve.engine.llm import LLM
from kvserve.kv.formats import flex_decode, make_kv_cache
from kvserve.planner.layout import KVLayout
from kvserve.model import float_kernels, int8_kernels, linear
from kvserve.model.float_kernels import BLAS, OneDNNMatmul
from kvserve.sampling_params import SamplingParams
from tests.conftest import make_tiny_model
from tests.model.test_deepseek import make_deepseek

COMPILED = dict(compile_decode=True)
COMMON = dict(kv_cache_memory="2MiB", max_model_len=512)
LOGPROB_TOLERANCE = 1e-4  # float32 rounding of fused elementwise ops through two layers, in nats
# int8 weights (W8A8): the graph rotates each activation in another order of sums than eager's BLAS (a few float32
# ulps), which moves a value that sits at a rounding boundary to the next int8 code, one level of 127 of its row's
# scale; the tiny model's 64 channels per row make one level coarse: up to 1.1e-2 nats measured (AVX-512 EPYC)
INT8_LOGPROB_TOLERANCE = 5e-2
# a lossy KV format stores what the graph computed, a few float32 ulps from eager's keys and values: one that sits at
# a rounding boundary is stored as the next code; test_formats_that_attend_their_own_way_... prints the largest
# deviation it saw (pytest -s): 1.4e-3 nats with int8 KV on the AVX-512 EPYC
LOSSY_KV_TOLERANCE = 1e-2
PROMPTS = [list(range(3, 40)), list(range(5, 90)), list(range(7, 20)), list(range(11, 28))]
ALIKE = [list(range(3, 40)), list(range(5, 44)), list(range(7, 41)), list(range(11, 50))]  # 34-39 tokens


@contextlib.contextmanager
def float_matmul(matmul):
    """Engines built inside multiply float weights by `matmul`, whatever this CPU's probe would pick."""
    with mock.patch.object(linear, "choose_matmul", lambda dtype, shapes=None: matmul):
        yield


@pytest.fixture(scope="module", params=[("llama-gqa", "blas"), ("gemma3-mqa", "blas"), ("llama-gqa", "onednn")],
                ids="-".join)
def engines(request, tmp_path_factory):
    """An eager and a compiled engine on one tiny model (gemma3-mqa: a sliding and a full-attention layer, two
    layer groups with their own block tables), their float weights multiplied by F.linear (in the graph at one row:
    the graph's own loop) or by oneDNN's linear over packed copies (model/float_kernels.py: an op of kvserve's own
    in the graph)."""
    kind, matmul = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(kind), kind=kind)
    with float_matmul(BLAS if matmul == "blas" else OneDNNMatmul()):
        eager = LLM(str(path), **COMMON, enforce_eager=True)
        compiled = LLM(str(path), **COMMON, **COMPILED)
    assert (compiled.engine.model.linears.matmul is BLAS) == (matmul == "blas")
    assert compiled.engine.runner.compiled is not None, "the decode step did not compile"
    # the warm-up's writes are put back: the pool is as zeroed as eager's
    assert all(bool((t == 0).all()) for t in compiled.engine.cache._block_tensors())
    return eager, compiled


def compare(eager: LLM, compiled: LLM, prompts, params: SamplingParams, some_compiled: bool = True,
            tolerance: float = LOGPROB_TOLERANCE, deviations: list[float] | None = None) -> list:
    """The same tokens with logprobs within `tolerance`; the only divergence allowed is at a near-tie, where
    eager's logprobs of the two tokens differ by less than the tolerance (rounding may pick either), and the
    sequence is compared up to there. Each compared logprob's |difference| goes to `deviations`, if given."""
    before = compiled.engine.runner.num_compiled_steps
    expected, got = eager.generate(prompts, params), compiled.generate(prompts, params)
    if some_compiled:
        assert compiled.engine.runner.num_compiled_steps > before, "no step ran compiled"
    for e, g in zip(expected, got):
        assert len(e.outputs) == len(g.outputs)
        for eo, go in zip(e.outputs, g.outputs):
            for i, (a, b) in enumerate(zip(eo.token_ids, go.token_ids)):
                if a != b:
                    tie = eo.logprobs[i]
                    assert b in tie and abs(tie[a] - tie[b]) <= tolerance, f"diverged at token {i}, no tie"
                    break
                deviation = abs(eo.logprobs[i][a] - go.logprobs[i][b])
                assert deviation <= tolerance
                if deviations is not None:
                    deviations.append(deviation)
            else:
                assert len(eo.token_ids) == len(go.token_ids)
    return got


def step_counts(llm: LLM) -> tuple[int, int, int]:
    """(steps, steps run compiled, steps run by the graph with attention outside) so far."""
    runner = llm.engine.runner
    return runner.num_steps, runner.num_compiled_steps, runner.compiled.num_outside_steps


def steps_since(llm: LLM, before: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(now - then for now, then in zip(step_counts(llm), before))


def test_decode_steps_match_eager_alone_and_batched(engines, monkeypatch):
    eager, compiled = engines
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    before = step_counts(compiled)
    compare(eager, compiled, PROMPTS[:1], params)  # one sequence: the whole graph; its prompt: attention outside
    assert steps_since(compiled, before) == (40, 40, 1)
    # several whose decodes are one attention call per layer group (alike lengths; float32's, read in place, any):
    # the whole graph too while their padded K/V is small (a tiny model's always is); their prompts' step outside
    for prompts in (ALIKE, PROMPTS):
        before = step_counts(compiled)
        compare(eager, compiled, prompts, params)
        assert steps_since(compiled, before) == (40, 40, 1)
    # past it: attention outside the graph that computes the rest, in one call per layer group or several
    monkeypatch.setattr(compiled_step, "WHOLE_GRAPH_KV_BYTES", 0)
    for prompts in (ALIKE, PROMPTS):
        before = step_counts(compiled)
        compare(eager, compiled, prompts, params)
        assert steps_since(compiled, before) == (40, 40, 40)


@pytest.mark.parametrize("windows", [[None] * 4, [8, None, 8, None, 8, 8]], ids=["one group", "hybrid"])
def test_the_whole_graphs_bound_counts_every_layers_keys(windows):
    # a hybrid model's slot holds its group's layers only: the padded K/V is every group's table (Gemma 3 270M's
    # 32 spread sequences ran the whole graph 1.41x slower than outside it while one group's table was counted)
    layout = KVLayout.from_layer_windows(windows)
    heads, dim, block = 2, 8, 4
    cache = make_kv_cache("float32", layout, 64, block, heads, dim, torch.float32)
    widths = [3, 1, 2][: layout.num_groups]
    meta = SimpleNamespace(groups=[[SimpleNamespace(block_tables=torch.zeros(2, w, dtype=torch.long))]
                                   for w in widths])
    # each layer reads its group's table: 2 requests x its width x the block's keys, K and V of float32
    assert compiled_step.padded_kv_bytes(cache, meta) == sum(
        2 * widths[layout.group_of[layer]] * block * 2 * heads * dim * 4 for layer in range(len(windows)))


def test_prompt_chunks_beside_decodes_and_drafts_run_the_graph_with_attention_outside(tmp_path):
    """Prefill steps run the graph with attention outside it as decode steps do (attention eager over the step's own
    metadata, the rest compiled): a prompt cut into chunks beside another request's decodes, its prompt logprobs
    within the tolerance of eager's, and speculative decoding's drafts verified in the same graph, eager's tokens."""
    from tests.engine.test_speculative import NGRAM, oracle

    path = make_tiny_model(tmp_path)
    options = dict(COMMON, max_num_batched_tokens=32)
    eager = LLM(str(path), **options, enforce_eager=True)
    compiled = LLM(str(path), **options, **COMPILED)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompts = [PROMPTS[2], PROMPTS[1]]  # 13 tokens, then 85 in chunks of at most 32 beside the first's decodes
    before = step_counts(compiled)
    expected = eager.generate(prompts, params)
    got = compare(eager, compiled, prompts, params)  # eager's tokens (up to a near-tie) and logprobs
    steps, compiled_steps, outside = steps_since(compiled, before)
    assert steps == compiled_steps and outside >= 4  # the prompts' 4 steps among them
    for e, g in zip(expected, got):
        assert len(e.prompt_logprobs) == len(g.prompt_logprobs) == len(e.prompt_token_ids)
        for token, a, b in zip(e.prompt_token_ids[1:], e.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert abs(a[token] - b[token]) <= LOGPROB_TOLERANCE  # the prompt's own token, always listed
            assert all(abs(a[t] - b[t]) <= LOGPROB_TOLERANCE for t in a.keys() & b.keys())
            for t in a.keys() ^ b.keys():  # a top-2 entry one side lacks: a near-tie at the 2nd rank
                shown, other = (a, b) if t in a else (b, a)
                assert any(abs(shown[t] - other[u]) <= LOGPROB_TOLERANCE for u in other.keys() - shown.keys())

    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    speculating = LLM(str(path), **COMMON, **COMPILED, speculative_config=NGRAM)
    references = eager.generate(ALIKE[:2], greedy)
    oracle(speculating, {tuple(o.prompt_token_ids): [c.token_ids for c in o.outputs] for o in references})
    before = step_counts(speculating)
    compare(eager, speculating, ALIKE[:2], greedy)  # eager's tokens (up to a near-tie), drafts verified
    assert speculating.stats()["spec_decode_num_accepted_tokens"] > 0
    steps, compiled_steps, outside = steps_since(speculating, before)
    assert steps == compiled_steps == outside < 30  # drafts verified: fewer steps than tokens, each compiled


def test_prefix_hits_chunked_prefill_beside_decodes_and_n_greater_than_one(engines):
    eager, compiled = engines
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    for llm in (eager, compiled):  # PROMPTS[1]'s blocks into both prefix caches
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1))
    hits = compare(eager, compiled, [PROMPTS[1] + [5, 6, 7], PROMPTS[1] + [8, 9]], params)
    assert all(output.num_cached_tokens >= 64 for output in hits)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, logprobs=2)
    compare(eager, compiled, ALIKE[:2], sampled)


def test_beam_search_keeps_eager_hypotheses(engines):
    """Beams decode as several sequences sharing blocks (copy-on-write as they fork), so their steps run the graph
    with attention outside it; the hypotheses are eager's, scores within the tolerance per token."""
    from kvserve.sampling_params import BeamSearchParams

    eager, compiled = engines
    runner = compiled.engine.runner
    steps = runner.num_compiled_steps
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    expected, got = eager.beam_search([PROMPTS[0]], params), compiled.beam_search([PROMPTS[0]], params)
    assert runner.num_compiled_steps > steps, "no beam step ran compiled"
    for e, g in zip(expected[0].sequences, got[0].sequences):
        assert e.token_ids == g.token_ids
        assert abs(e.cumulative_logprob - g.cumulative_logprob) <= LOGPROB_TOLERANCE * len(e.token_ids)


@pytest.mark.parametrize("whole_graph_kv_bytes", [compiled_step.WHOLE_GRAPH_KV_BYTES, 0])
def test_new_batch_sizes_and_context_lengths_run_the_same_graph(engines, monkeypatch, whole_graph_kv_bytes):
    """Several sequences in the whole graph (the default, a tiny model's K/V being small) or with attention outside
    it (0): any number of them, at any context length, runs the graph compiled at start."""
    _, compiled = engines
    monkeypatch.setattr(compiled_step, "WHOLE_GRAPH_KV_BYTES", whole_graph_kv_bytes)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    before = step_counts(compiled)
    params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)  # contexts cross several blocks
    for num_seqs in (1, 3, 5):
        compiled.generate([list(range(2 + i, 60 + 2 * i)) for i in range(num_seqs)], params)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a step recompiled"
    steps, compiled_steps, outside = steps_since(compiled, before)
    assert steps == compiled_steps == 3 * 70 and compiled.engine.runner.compiled.num_misses == 0
    assert outside == (3 if whole_graph_kv_bytes else 3 + 2 * 69)  # the prompts' steps; several's decodes


def test_one_rows_logits_run_the_compiled_head(engines, monkeypatch):
    """A float output head (compile/steps.py, head_in_graph): one row's logits, a single stream's at every step (its
    prompt's last row too), run in a graph of their own, where the matrix-vector product is Inductor's loop over every
    core (model/linear.py, one_row_in_graph), over the dense weights that --compile-decode keeps beside oneDNN's
    packed copy too; several rows' logits run eagerly. Both within the tolerance (compare)."""
    eager, compiled = engines
    model = compiled.engine.model
    eager_rows = []
    head = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: eager_rows.append(hidden.shape[0]) or head(hidden))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, PROMPTS[:1], params)
    assert eager_rows == [], "a single stream's logits ran the eager head"
    compare(eager, compiled, ALIKE[:2], params)
    assert eager_rows and all(rows > 1 for rows in eager_rows)


def test_which_heads_get_a_graph_of_their_own(tmp_path):
    """A head gets a graph of its own where one row's product is the graph's loop (one_row_in_graph): float weights
    held dense, or int8 codes kept as they are (only --compile-decode keeps them, for the kernels a loop replaces);
    not oneDNN's packed float head without the dense weights, nor an int8 head without its codes, whose call would be
    the same kernel in a graph and out of one."""
    path = make_tiny_model(tmp_path)
    with float_matmul(BLAS):
        assert compiled_step.head_in_graph(LLM(str(path), **COMMON, enforce_eager=True).engine.model)
    with float_matmul(OneDNNMatmul()):
        assert not compiled_step.head_in_graph(LLM(str(path), **COMMON, enforce_eager=True).engine.model)
    int8 = LLM(str(path), **COMMON, quantization="int8", enforce_eager=True).engine.model
    assert not compiled_step.head_in_graph(int8)  # compiled: test_int8_weights_decode_compiled_as_eager


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_compile_decode_keeps_dense_weights_beside_onednns_for_the_one_row_loops(tmp_path, caplog, monkeypatch, tied):
    """oneDNN's packed float weights replace the dense ones (model/float_kernels.py), but a compiled single stream
    multiplies one row in loops of its own over dense weights (model/linear.py, one_row_in_graph): --compile-decode
    keeps them beside the packed copies, its cost counted in the weights and said at start (a tied head reads the
    embedding table, kept anyway), and the single stream's steps call oneDNN no more; batched steps still do."""
    path = make_tiny_model(tmp_path, tie_word_embeddings=tied)
    with float_matmul(OneDNNMatmul()):
        eager = LLM(str(path), **COMMON, enforce_eager=True).engine.model
        with caplog.at_level(logging.INFO, logger="kvserve"):
            llm = LLM(str(path), **COMMON, **COMPILED)
    model = llm.engine.model
    assert eager.linears.dense_copy_nbytes == 0 and all(layer.qkv.weight is None for layer in eager.layers)
    dense = sum(linear.weight.nbytes for layer in model.layers for linear in layer.weight_parts()[:4])
    if not tied:
        dense += model.lm_head.weight.nbytes
    assert model.linears.dense_copy_nbytes == dense > 0
    assert model.weights_nbytes == eager.weights_nbytes + dense
    assert f"{dense / 1e6:,.1f} MB the dense weights kept beside oneDNN linear's packed copies" in caplog.text
    calls = []
    onednn = float_kernels._onednn_linear_eager
    monkeypatch.setattr(float_kernels, "_onednn_linear_eager", lambda *args: calls.append(args[0].shape[0]) or
                        onednn(*args))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = step_counts(llm)
    llm.generate(PROMPTS[:1], params)
    assert steps_since(llm, before) == (6, 6, 1) and calls and all(rows > 1 for rows in calls)  # the prompt's step
    calls.clear()
    llm.generate(ALIKE[:2], params)
    assert 2 in calls  # the batched graph's steps: oneDNN over its packed copies


def test_preemption_mid_decode_matches_eager(tmp_path):
    path = make_tiny_model(tmp_path)
    tight = dict(kv_cache_memory="48KiB", max_model_len=96)  # 96 tokens: the four requests cannot all stay
    eager = LLM(str(path), **tight, enforce_eager=True)
    compiled = LLM(str(path), **tight, **COMPILED)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, [p[:30] for p in ALIKE], params)
    assert compiled.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kernel", [int8_kernels.IntMMKernel(), int8_kernels.OneDNNKernel(),
                                    int8_kernels.FloatKernel(), int8_kernels.FbgemmKernel()],
                         ids=lambda k: k.name)
def test_int8_weights_decode_compiled_as_eager(tmp_path, monkeypatch, kernel):
    """W8A8 weights in the graph, with each route a CPU's probe may pick: the rotations of the activations (and of a
    tied table's rows) are Inductor's own loops there (kvserve/rotation.py), rounded otherwise than eager's BLAS
    (INT8_LOGPROB_TOLERANCE); the integer sums stay the int8 kernel's, exact on every CPU. (oneDNN's op rides in the
    graph as an op of kvserve's own, which Inductor calls as is: it lowers oneDNN's only over frozen weights.) Over
    the integer kernels' weights a single stream's graphs, its head's included, sum one row's codes in loops of their own
    (model/linear.py, one_row_sums): the same integers."""
    if not kernel.available():
        pytest.skip(f"{kernel.name} is not available or not exact on this CPU")
    monkeypatch.setattr(linear, "choose_kernel", lambda shapes=None: kernel)
    path = make_tiny_model(tmp_path, tie_word_embeddings=True)  # tied: the graph's lookups rotate rows back
    eager = LLM(str(path), **COMMON, quantization="int8", enforce_eager=True)
    compiled = LLM(str(path), **COMMON, **COMPILED, quantization="int8")
    assert compiled.engine.runner.compiled is not None, "the decode step did not compile"
    assert compiled.engine.model.linears.kernel is kernel
    loops = kernel.loops_at_one_row  # the integer kernels' (model/int8_kernels.py), not the float32 fallback's
    assert compiled_step.head_in_graph(compiled.engine.model) == loops == compiled.engine.model.linears.one_row_loops
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, PROMPTS[:1], params, tolerance=INT8_LOGPROB_TOLERANCE)
    compare(eager, compiled, ALIKE, params, tolerance=INT8_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("options, reason, tolerance", [
    (dict(kv_cache_dtype="int8"), "the int8 KV cache attends with its own compiled decode kernel", LOSSY_KV_TOLERANCE),
    (dict(kv_cache_dtype="int4"), "the int4 KV cache attends with its own compiled decode kernel", LOSSY_KV_TOLERANCE),
    (dict(kv_cache_dtype="fp8"), "the fp8_e4m3 KV cache attends eagerly", LOSSY_KV_TOLERANCE),
    (dict(kv_cache_dtype="fp8_e5m2"), "the fp8_e5m2 KV cache attends eagerly", LOSSY_KV_TOLERANCE),
    (dict(kv_cache_dtype="nuq4"), "the nuq4 KV cache attends with its own compiled decode kernel", LOSSY_KV_TOLERANCE),
    (dict(kv_cache_dtype="nuq3"), "the nuq3 KV cache attends with its own compiled decode kernel", LOSSY_KV_TOLERANCE),
    (dict(kv_cache_dtype="nuq3k4v"), "the nuq3k4v KV cache attends with its own compiled decode kernel",
     LOSSY_KV_TOLERANCE),
    (dict(kv_eviction="h2o", kv_budget_tokens=64, kv_recent_tokens=32), "H2O's attention scores", LOGPROB_TOLERANCE),
])
def test_formats_that_attend_their_own_way_run_the_graph_with_attention_outside(tmp_path, caplog, options, reason,
                                                                               tolerance):
    """KV formats with a decode kernel or a storage of their own, and H2O's scores, keep attention outside the graph
    at every decode step, a single stream's too: the graph computes the rest, attention runs as in eager."""
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, enforce_eager=True, **options)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        compiled = LLM(str(path), **COMMON, **COMPILED, **options)
    assert f"one compiled graph with attention outside it (torch.compile, --enforce-eager turns it off; {reason}" in \
        caplog.text
    runner = compiled.engine.runner
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    deviations = []
    compare(eager, compiled, PROMPTS[:1], params, tolerance=tolerance, deviations=deviations)
    assert step_counts(compiled) == (40, 40, 40)  # every step, the prompt's too
    compare(eager, compiled, PROMPTS, params, tolerance=tolerance, deviations=deviations)
    assert step_counts(compiled) == (80, 80, 80)
    assert runner.compiled.num_misses == 0 and runner.compiled.failed is None
    # int8 and int4 attend with their own compiled kernel, called from the graph's attention op: those calls must fit
    # the kernel's graphs (built in inference mode, as eager steps call it), or it fails and attends eagerly for good
    fused = compiled.engine.cache.fused_decode  # float32 (H2O's) reads blocks in place where it attends unscored
    assert (fused is not None) == (options.get("kv_cache_dtype", "auto") in ("int8", "int4", "nuq4", "nuq3", "nuq3k4v",
                                                                             "auto"))
    assert fused is None or fused.failed is None, fused.failed
    print(f"\n{reason}: largest logprob deviation from eager {max(deviations):.1e} nats over {len(deviations)}")


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_half_precision_pools_run_inside_the_whole_graph_as_eager(tmp_path, kv_cache_dtype):
    """The float formats other than float32's: attention inside the whole graph for a single stream, logprobs
    within the lossy formats' tolerance of eager over the same pool (both round K/V the same way when stored)."""
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    compiled = LLM(str(path), **COMMON, **COMPILED, kv_cache_dtype=kv_cache_dtype)
    assert compiled.engine.runner.compiled.whole
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, PROMPTS[:1], params, tolerance=LOSSY_KV_TOLERANCE)
    compare(eager, compiled, PROMPTS, params, tolerance=LOSSY_KV_TOLERANCE)


@pytest.mark.parametrize("options, reason", [
    (dict(batch_invariant=True), "--batch-invariant runs fixed tiles eagerly"),
    (dict(kv_eviction="streaming", kv_recent_tokens=64), "a streaming sequence's positions outgrow"),
    (dict(deepseek=True), "DeepseekModel is not compiled (Llama and Gemma 3 families only)"),
])
def test_what_the_graph_does_not_cover_runs_eagerly_and_says_why(tmp_path, caplog, options, reason):
    """...and keeps dense weights beside oneDNN's packed ones only for its eager steps' one-row loop (OneRowLoop), not
    for a graph's; --batch-invariant compiles no loop and keeps F.linear, over the dense weights alone."""
    options = dict(options)
    path = make_deepseek(tmp_path) if options.pop("deepseek", False) else make_tiny_model(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvserve"), float_matmul(OneDNNMatmul()):
        llm = LLM(str(path), **COMMON, **COMPILED, **options)
    assert llm.engine.runner.compiled is None
    assert f"decode steps: eager ({reason}" in caplog.text
    batch_invariant = options.get("batch_invariant", False)  # which keeps F.linear, over the dense weights
    linears = llm.engine.model.linears
    assert not linears.dense_in_graph and (linears.one_row is None) == batch_invariant
    assert (linears.dense_copy_nbytes > 0) != batch_invariant and llm.engine.model.lm_head.weight is not None
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))


def test_compile_decode_and_enforce_eager_contradict(tmp_path):
    with pytest.raises(ValueError, match="compile_decode=True contradicts enforce_eager=True"):
        LLM(str(make_tiny_model(tmp_path)), **COMMON, compile_decode=True, enforce_eager=True)
    with pytest.raises(ValueError, match="compile_gemms=True applies to the compiled decode step, which "
                                         "--no-compile-decode turns off"):
        LLM(str(make_tiny_model(tmp_path)), **COMMON, compile_gemms=True, compile_decode=False)


def _graphs_of(monkeypatch, cls, method: str) -> list[int]:
    """Graphs Dynamo compiles inside each later call of cls.method, one count per call."""
    counts, original = [], getattr(cls, method)

    def counting(*args, **kwargs):
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        original(*args, **kwargs)
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)

    monkeypatch.setattr(cls, method, counting)
    return counts


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3-mqa"])  # gemma3-mqa: two layer groups, each padded
def test_compiled_gemms_freeze_the_weights_and_match_eager(tmp_path, caplog, monkeypatch, kind):
    """--compile-gemms: the weights are frozen into the graph (Inductor's freezing packs each linear's weight, which
    it counts; a graph that kept the weights as inputs packs none and fails here), whichever GEMM its benchmark then
    picks on this CPU, the template or the BLAS call. It is one graph, one packed copy: a single sequence runs it as
    two identical ones. Decode steps give eager's tokens and logprobs within the tolerance, alone and batched, and the
    weights the eager steps use are the model's own, unchanged. (Weights that F.linear multiplies: oneDNN's packed
    ones are not frozen, test_compile_gemms_is_not_applied_over_onednn_float_weights.)"""
    monkeypatch.setattr(linear, "choose_matmul", lambda dtype, shapes=None: BLAS)
    path = make_tiny_model(tmp_path, kind=kind)
    eager = LLM(str(path), **COMMON, enforce_eager=True)
    packed = torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    in_place = _graphs_of(monkeypatch, flex_decode.InPlaceFloatKVCache, "warm_up")  # its attention: its own count
    with caplog.at_level(logging.INFO, logger="kvserve"):
        compiled = LLM(str(path), **COMMON, **COMPILED, compile_gemms=True)
    assert compiled.engine.runner.compiled is not None and compiled.engine.runner.compiled.failed is None
    # the frozen graph, the one with attention outside, whose weights stay inputs (no second packed copy), and the
    # float32 output head's for one row (compile/steps.py, head_in_graph)
    graphs += sum(in_place)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 3
    # two layers, four linears each
    assert torch._dynamo.utils.counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] - packed >= 8
    assert "multiplied by Inductor's C++ GEMM template over its own packed copy" in caplog.text
    weight = compiled.engine.model.layers[0].qkv.weight
    assert isinstance(weight, torch.nn.Parameter) and torch.equal(weight, eager.engine.model.layers[0].qkv.weight)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, PROMPTS[:1], params)
    # every decode step of the single sequence in the frozen graph, its prompt in the one with attention outside
    assert step_counts(compiled) == (40, 40, 1)
    compare(eager, compiled, ALIKE, params)
    compare(eager, compiled, [[3, 4, 5]], params)  # one sequence, one block: both widened
    before = step_counts(compiled)
    # lengths far apart: float32 blocks are read in place (kv/formats/flex_decode.py), so their decodes are one
    # attention call per layer group too, which the frozen graph takes (padded to the longest inside it)
    compare(eager, compiled, PROMPTS, params)
    assert steps_since(compiled, before) == (40, 40, 1)  # the prompts' step alone with attention outside
    assert compiled.engine.runner.compiled.num_misses == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 3, "serving compiled a graph"


@pytest.mark.parametrize("kernel, applied", [(int8_kernels.IntMMKernel(), False), (int8_kernels.FloatKernel(), True),
                                             (int8_kernels.OneDNNKernel(), True)])
def test_compile_gemms_is_not_applied_over_an_int8_kernel(tmp_path, caplog, monkeypatch, kernel, applied):
    """Inductor's GEMM template multiplies float weights, and oneDNN's int8 ones (it lowers oneDNN's op): weights that
    torch._int_mm multiplies stay its calls, so --compile-gemms would only add its costs (measured slower on the
    AVX-512 EPYC); the start-up line says it is not applied. The int8 codes multiplied as float32 (FloatKernel, where
    no int8 kernel is faster) are float weights to it."""
    monkeypatch.setattr(linear, "choose_kernel", lambda shapes=None: kernel)  # whatever this CPU's probe would pick
    path = make_tiny_model(tmp_path)
    model = LLM(str(path), **COMMON, quantization="int8", enforce_eager=True).engine.model
    assert (compiled_step.gemms_unused(model) is None) == applied
    if applied:
        return  # test_compiled_gemms_freeze_the_weights_and_match_eager and the one below compile one
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(path), **COMMON, **COMPILED, quantization="int8", compile_gemms=True)
    assert llm.engine.runner.compiled is not None and not llm.engine.runner.compiled.gemms
    assert "--compile-gemms: not applied (the int8 weights are multiplied by torch._int_mm" in caplog.text


def test_compile_gemms_is_not_applied_over_onednn_float_weights(tmp_path, caplog, monkeypatch):
    """Float weights that oneDNN's linear multiplies over its packed copies (model/float_kernels.py) are an op of
    kvserve's own in the graph, which Inductor's GEMM template does not replace: --compile-gemms is not applied, and
    the start-up line says so."""
    monkeypatch.setattr(linear, "choose_matmul", lambda dtype, shapes=None: OneDNNMatmul())
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(make_tiny_model(tmp_path)), **COMMON, **COMPILED, compile_gemms=True)
    assert llm.engine.runner.compiled is not None and not llm.engine.runner.compiled.gemms
    assert "--compile-gemms: not applied (the weights are multiplied by oneDNN linear" in caplog.text


@pytest.mark.skipif(not int8_kernels.OneDNNKernel().available(),
                    reason="oneDNN's int8 linear returns wrong sums on this CPU (no VNNI): it is never used here")
def test_compiled_gemms_lower_onednn_int8_weights_to_inductors_gemm(tmp_path, caplog, monkeypatch):
    """--compile-gemms over int8 weights that oneDNN multiplies: the graph calls oneDNN's op over the packed weights
    frozen into it, and Inductor lowers each call (it counts them: a graph whose weights stayed inputs lowers none,
    and fails compiling). Integer sums are exact in any order, so tokens and logprobs are eager's within the int8
    tolerance of the rest of the graph (its rotations and norms), alone and batched."""
    monkeypatch.setattr(linear, "choose_kernel", lambda shapes: int8_kernels.OneDNNKernel())
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, quantization="int8", enforce_eager=True)
    lowered = torch._dynamo.utils.counters["inductor"]["qlinear_unary_lower_count"]
    with caplog.at_level(logging.INFO, logger="kvserve"):
        compiled = LLM(str(path), **COMMON, **COMPILED, quantization="int8", compile_gemms=True)
    assert compiled.engine.runner.compiled is not None and compiled.engine.runner.compiled.failed is None
    assert compiled.engine.runner.compiled.gemms and "--compile-gemms: not applied" not in caplog.text
    assert torch._dynamo.utils.counters["inductor"]["qlinear_unary_lower_count"] - lowered >= 8  # 2 layers, 4 each
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, PROMPTS[:1], params, tolerance=INT8_LOGPROB_TOLERANCE)
    compare(eager, compiled, ALIKE, params, tolerance=INT8_LOGPROB_TOLERANCE)
    assert compiled.engine.runner.compiled.num_misses == 0


def test_the_graphs_guard_the_step_not_the_weights(tmp_path, monkeypatch):
    """Dynamo's guards on the model's weights and layers are dropped (the engine never changes them), those on the
    step are kept: a step that no graph fits is still caught (the tests above on misses), and its inputs are
    guarded here."""
    seen, step_guards = [], compiled_step.step_guards

    def spy(entries):
        keep = step_guards(entries)
        seen.extend(zip(entries, keep))
        return keep

    monkeypatch.setattr(compiled_step, "step_guards", spy)
    LLM(str(make_tiny_model(tmp_path)), **COMMON, **COMPILED)
    tensors = [(entry.name, keep) for entry, keep in seen if entry.guard_type == "TENSOR_MATCH"]
    assert any(name.startswith("meta.layer_regions[") and not keep for name, keep in tensors), tensors
    assert any(name == "input_ids" and keep for name, keep in tensors), tensors
    assert any(name.startswith("meta.") and not name.startswith("meta.layer_regions[") and keep
               for name, keep in tensors), tensors


class BrokenCompile:
    """torch.compile on a machine whose compiler fails: at start, as the graph is compiled."""

    def __init__(self, fn, **kwargs):
        pass

    def aot_compile(self, example_inputs):
        raise RuntimeError("C++ compiler not found")


def test_a_graph_that_fails_falls_back_to_eager_once_and_serving_goes_on(tmp_path, caplog, monkeypatch):
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, enforce_eager=True)

    monkeypatch.setattr(saved_graphs.torch, "compile", BrokenCompile)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(str(path), **COMMON, **COMPILED)
    assert llm.engine.runner.compiled is None
    assert caplog.text.count("compiled decode step failed (RuntimeError: C++ compiler not found)") == 1
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]


STARTING_PROCESS = """
import json, sys, torch
from kvserve.engine.llm import LLM
from kvserve.kv.formats import flex_decode, make_kv_cache
from kvserve.planner.layout import KVLayout
from kvserve.sampling_params import SamplingParams
from kvserve.model import float_kernels, linear
# the float matmul pinned (its probe could pick another route in a start on a loaded machine: another graph)
linear.choose_matmul = lambda dtype, shapes=None: float_kernels.BLAS
llm = LLM(sys.argv[1], kv_cache_memory="2MiB", max_model_len=512, compile_decode=True, **json.loads(sys.argv[2]))
compiled = llm.engine.runner.compiled
assert compiled is not None
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
tokens = [o.outputs[0].token_ids for o in llm.generate([list(range(3, 40)), list(range(7, 20))], params)]
assert compiled.num_misses == 0 and llm.engine.runner.num_compiled_steps > 0
print(json.dumps([compiled.graphs_loaded, compiled.graphs_compiled, tokens]))
"""


def test_a_second_start_loads_its_graphs_and_a_changed_model_or_format_compiles_its_own(tmp_path):
    """A start saves its compiled graphs (kvserve/saved_graphs.py); a second start of the same engine loads them all
    and traces nothing, and serves the same tokens. A model with other weights of the same sizes loads them too
    (weights are the graphs' inputs, read at every call) and serves that model's own tokens: the tokens graphs
    compiled for it from scratch serve (the same code on the same machine: equal on any CPU); a bfloat16 pool or
    a model of other sizes names other graphs and compiles them. Each start is a process of its own on one cache
    directory. (The torch version and the machine cannot change within a test: test_graph_cache.py shows they are
    in the name.)"""
    small, other = make_tiny_model(tmp_path / "small"), make_tiny_model(tmp_path / "other", seed=1)
    wide = make_tiny_model(tmp_path / "wide", intermediate_size=160)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # empty: this test's own

    def start(path, cache=env, **options) -> tuple[int, int, list]:
        done = subprocess.run([sys.executable, "-c", STARTING_PROCESS, str(path), json.dumps(options)], env=cache,
                              cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return tuple(json.loads(done.stdout.splitlines()[-1]))

    loaded, compiled, tokens = start(small)
    assert (loaded, compiled) == (0, 4)
    assert start(small) == (4, 0, tokens)
    loaded, compiled, other_tokens = start(other)
    assert (loaded, compiled) == (4, 0) and other_tokens != tokens
    fresh = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh")}  # nothing saved: compiled for it
    assert start(other, cache=fresh) == (0, 4, other_tokens)
    assert start(small, kv_cache_dtype="bfloat16")[:2] == (0, 4)
    assert start(wide)[:2] == (0, 4)


def test_contexts_of_one_block_run_the_graph_widened(engines):
    """A context of up to one block (Dynamo specializes a size of 1) runs the graph with its table widened to two
    blocks, the second masked: no step of a short prompt runs eagerly or compiles."""
    eager, compiled = engines
    runner = compiled.engine.runner
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    steps, misses = runner.num_compiled_steps, runner.compiled.num_misses
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    compare(eager, compiled, [[3, 4, 5]], params)  # positions 3..32: blocks 1, 2 and 3
    compare(eager, compiled, [[3, 4, 5], [6, 7, 8]], params)
    assert runner.num_compiled_steps == steps + 2 * 30  # every step of both runs
    assert runner.compiled.num_misses == misses and runner.compiled.failed is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a step recompiled"


def test_a_step_no_graph_fits_runs_eagerly_with_one_warning_and_serving_goes_on(tmp_path, caplog, monkeypatch):
    """A decode step that would need a new graph is not compiled while serving (that would stall every request
    for the compile's duration): it runs eagerly, the graph stays in use for the next steps."""
    path = make_tiny_model(tmp_path)
    eager = LLM(str(path), **COMMON, enforce_eager=True)
    compiled = LLM(str(path), **COMMON, **COMPILED)
    monkeypatch.setattr(compiled_step, "at_least_two_blocks", lambda meta: meta)  # one-block steps: a new graph
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        compare(eager, compiled, [[3, 4, 5]], params)
    runner = compiled.engine.runner
    assert runner.compiled.num_misses == 13  # positions 3..15: a one-block table
    assert steps_since(compiled, (0, 0, 0)) == (30, 30 - 13, 1) and runner.compiled.failed is None
    assert caplog.text.count("a decode step fits no compiled graph") == 1
    assert "L['meta'].groups[0][0].mask" in caplog.text  # the reason: the guard on a one-block table's mask
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "serving compiled a graph"


def test_every_engine_in_a_process_compiles_its_own_graphs(tmp_path, monkeypatch):
    """Engines of different sizes in one process each compile their own three graphs (the two decode graphs and the
    float output head's), and each runs its decode steps in them. (With torch.compile's own dispatch, Dynamo kept at
    most 8 graphs per code object: the fifth and later engines ran eagerly, unsaid, when all shared one.)"""
    monkeypatch.setattr(linear, "choose_matmul", lambda dtype, shapes=None: BLAS)  # F.linear's head: a graph of its own
    path = make_tiny_model(tmp_path)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(6):
        llm = LLM(str(path), kv_cache_memory=f"{2 + i}MiB", max_model_len=512, **COMPILED)  # pool sizes differ
        compiled = llm.engine.runner.compiled
        assert compiled is not None and (compiled.graphs_loaded, compiled.graphs_compiled) == (0, 4), i
        llm.generate([PROMPTS[0]], params)
        assert step_counts(llm) == (20, 20, 1)


@pytest.mark.parametrize("options", [{}, dict(compile_gemms=True)])
def test_a_dropped_compiled_engine_frees_its_model(tmp_path, options):
    """Dynamo's guards keep a compiled function's globals alive after the engine is gone: the engine's model (its
    weights) must not be among them, or every engine built and dropped in one process (the bench builds one per
    configuration and round) keeps a model. Eager engines free theirs; compiled ones must too."""
    path = make_tiny_model(tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    refs = []
    for compiled in (False, True):
        llm = LLM(str(path), **COMMON, **(dict(COMPILED, **options) if compiled else dict(enforce_eager=True)))
        llm.generate(ALIKE[:2], params)
        assert llm.engine.runner.num_compiled_steps > 0 or not compiled
        refs.append((weakref.ref(llm.engine), weakref.ref(llm.engine.model), weakref.ref(llm.engine.cache)))
        del llm
    gc.collect()
    assert [[r() is None for r in engine] for engine in refs] == [[True] * 3] * 2, \
        "(engine, model, cache) of the eager and the compiled engine still alive"


def test_a_model_that_does_not_trace_as_one_graph_fails_at_start_said_once(tmp_path, caplog, monkeypatch):
    """A graph is compiled whole (torch's AOT precompile takes no graph breaks): where tracing breaks, the start says
    so once and decode steps run eagerly; nothing is saved for the next start."""
    def breaking(x):
        torch._dynamo.graph_break()
        return False

    monkeypatch.setattr(linear, "one_row_in_graph", breaking)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(str(make_tiny_model(tmp_path)), **COMMON, **COMPILED)
    assert llm.engine.runner.compiled is None
    assert caplog.text.count("compiled decode step failed") == 1
    assert not list(saved_graphs.graph_directory().glob("*.bin"))


def test_the_graphs_skip_inductors_per_call_input_checks(tmp_path):
    """The step's generated code checks no input's sizes, strides or alignment at each call (Dynamo's guards check
    the step's inputs; the weights and the pool never change): some 1,100 checks a step for SmolLM2
    (docs/benchmarks.md). The graphs still compute eager's tokens."""
    from torch._inductor.graph import GraphLowering  # Inductor's, imported where it compiles

    path, codes = make_tiny_model(tmp_path), []
    # the code Inductor writes for each step graph while the engine compiles them (not
    # torch._inductor.utils.run_and_get_code: it resets Dynamo, which would drop the graphs of the engines other tests
    # in this process hold), generated here, not loaded from cache; the KV cache's decode attention, compiled before
    # them (or not at all, where another test of this process compiled its shapes), is a function of its own
    warm_up = compiled_step.CompiledSteps.warm_up

    def recording(self):
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            return warm_up(self)

    with torch._inductor.config.patch(fx_graph_cache=False), \
            mock.patch.object(compiled_step.CompiledSteps, "warm_up", recording):
        llm = LLM(str(path), **COMMON, **COMPILED)
    assert llm.engine.runner.compiled is not None
    assert len(codes) >= 2, "both graphs' code (whole, attention outside)"
    for code in codes:
        assert "def call(" in code
        assert "assert_size_stride(" not in code and "assert_alignment(" not in code
    eager = LLM(str(path), **COMMON, enforce_eager=True)
    compare(eager, llm, PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, logprobs=1))
