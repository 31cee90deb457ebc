"""The matmul probes time the routes on the loaded model's own matrix shapes (kvserve/model/probe_shapes.py), and
each model structure keeps a remembered choice of its own (route_cache.py)."""
import json
import logging

import pytest
import torch

from kvserve.model import float_kernels, int8_kernels, probe_shapes, route_cache
from kvserve.model.int8_kernels import FloatKernel, KernelChoice
from kvserve.model.probe_shapes import FIXED, ProbedShape, WeightShapes
from tests.model.test_route_cache import Exact


def test_the_shapes_are_the_checkpoints_matrices_counted_most_bytes_first():
    weights = {"model.embed_tokens.weight": torch.empty(256, 64), "lm_head.weight": torch.empty(256, 64),
               "model.norm.weight": torch.empty(64),
               **{f"model.layers.{i}.mlp.{p}_proj.weight": torch.empty(128, 64) for i in range(2) for p in ("gate",
                                                                                                           "up")},
               **{f"model.layers.{i}.mlp.down_proj.weight": torch.empty(64, 128) for i in range(2)},
               **{f"model.layers.{i}.self_attn.q_proj.weight": torch.empty(64, 64) for i in range(2)},
               "model.layers.0.linear_attn.conv1d.weight": torch.empty(8, 1, 4)}
    # untied: the embedding is looked up, the head multiplied; vectors and the conv's taps are not matrices
    assert WeightShapes.of_weights(weights, tied=False).counts == ((128, 64, 4), (64, 128, 2), (256, 64, 1),
                                                                   (64, 64, 2))
    del weights["lm_head.weight"]
    assert WeightShapes.of_weights(weights, tied=True).counts == ((128, 64, 4), (64, 128, 2), (256, 64, 1),
                                                                  (64, 64, 2))
    with pytest.raises(ValueError, match="without matrices"):
        WeightShapes.of_weights({"model.norm.weight": torch.empty(64)}, tied=False)


def test_the_probe_times_the_shapes_holding_most_bytes_each_from_memory(monkeypatch):
    monkeypatch.setattr(probe_shapes, "PROBE_BYTES", 4096)
    # 16x16 float32 is 1,024 bytes: four copies fill the probe's bytes; a 64x64 weight is sliced to 16 of its rows
    shapes = WeightShapes(((64, 64, 3), (16, 16, 30), (16, 16, 1)))
    assert shapes.timed(4) == [ProbedShape(16, 64, 1, 3 * 64 / 16), ProbedShape(16, 16, 4, 30 / 4)]
    assert shapes.timed(1) == [ProbedShape(64, 64, 1, 3.0), ProbedShape(16, 16, 16, 30 / 16)]
    # the shapes past 90% of the bytes, or past the fourth, are not timed
    many = WeightShapes(tuple((16 * (8 - i), 16, 1) for i in range(7)))
    assert len(many.timed(1)) == probe_shapes.MAX_TIMED


def test_a_token_time_scales_each_shapes_copies_to_the_models_count(monkeypatch):
    timed = [ProbedShape(16, 64, 1, 12.0), ProbedShape(16, 16, 4, 7.5)]
    called = []
    monkeypatch.setattr(probe_shapes, "best_time", lambda fn, reps=5: (fn(), 0.5)[1])
    seconds = probe_shapes.token_time(timed, [["a"], ["b", "c", "d", "e"]], ["x", "y"],
                                      lambda x, w: called.append((x, w)))
    assert seconds == 12.0 * 0.5 + 7.5 * 0.5
    assert called == [("x", "a"), ("y", "b"), ("y", "c"), ("y", "d"), ("y", "e")]


@pytest.fixture
def route_file(monkeypatch, tmp_path):
    path = tmp_path / "cache" / route_cache.FILE_NAME
    monkeypatch.setattr(route_cache, "route_file", lambda: path)
    return path


def test_each_model_structure_keeps_a_choice_of_its_own(route_file, monkeypatch):
    """Two models alternating on one machine: each is probed once, on its own shapes, and remembered under them."""
    probed = []
    monkeypatch.setattr(int8_kernels, "probe_kernels", lambda kernels, shapes: probed.append(shapes) or
                        KernelChoice(kernels[0], {1: 2.0, 64: 3.0}))
    small, large = WeightShapes(((128, 64, 4),)), WeightShapes(((4096, 1024, 60),))
    for shapes in (small, large, small, large):
        int8_kernels.remembered_or_probed((Exact(),), shapes)
    assert probed == [small, large]
    entries = json.loads(route_file.read_text())["entries"]
    assert {name: entry["key"]["probe"]["shapes"] for name, entry in entries.items()} == {
        route_cache.entry_name("int8", small): [[128, 64, 4]],
        route_cache.entry_name("int8", large): [[4096, 1024, 60]]}


def test_the_float_probe_times_the_models_shapes(monkeypatch):
    """Every weight the probe multiplies has one of the timed shapes, in the probe's dtype."""
    seen = set()
    real = probe_shapes.token_time

    def token_time(timed, weights, inputs, multiply):
        seen.update((tuple(w.shape), w.dtype) for copies in weights for w in copies if isinstance(w, torch.Tensor))
        return real(timed, weights, inputs, multiply)

    monkeypatch.setattr(float_kernels, "token_time", token_time)
    float_kernels.probe_matmuls(torch.bfloat16, (float_kernels.OneDNNMatmul(),),
                                WeightShapes(((96, 32, 3), (32, 48, 2))))
    assert seen == {((96, 32), torch.bfloat16), ((32, 48), torch.bfloat16)}


def test_a_loaded_model_probed_its_own_shapes(tmp_path):
    from kvserve.engine.llm import LLM
    from tests.conftest import make_tiny_model

    model = LLM(str(make_tiny_model(tmp_path)), kv_cache_memory="2MiB", max_model_len=256,
                enforce_eager=True).engine.model
    counts = dict(((n, k), c) for n, k, c in model.linears.shapes.counts)
    # the tiny llama-gqa: 2 layers, hidden 64, intermediate 128, 4 heads of 16 over 2 KV heads, an untied head
    assert counts[128, 64] == 4 and counts[64, 128] == 2 and counts[256, 64] == 1 and counts[64, 64] == 4
    assert model.linears.shapes != FIXED



def test_a_start_that_probed_says_how_long_the_probe_took(route_file, monkeypatch, caplog):
    monkeypatch.setattr(int8_kernels, "probe_kernels", lambda kernels, shapes: KernelChoice(FloatKernel()))
    shapes = WeightShapes(((128, 64, 4),))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        int8_kernels.choose_kernel.__wrapped__(shapes)  # probed: the line says how long it took
        int8_kernels.choose_kernel.__wrapped__(shapes)  # remembered: no probe to time
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("int8 matmuls:")]
    assert len(lines) == 2 and "probed now" in lines[0] and "(the probe took " in lines[0]
    assert "remembered from the probe of" in lines[1] and "the probe took" not in lines[1]
