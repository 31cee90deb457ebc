"""The probes' matmul routes are remembered per machine (kvserve/model/route_cache.py): reused without probing while
everything they depend on is the same, probed again and rewritten when anything changed or the file cannot be
trusted. The probes here are counted fakes (which route wins is the probe's rule, tested elsewhere)."""
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from kvserve import saved_graphs
from kvserve.model import float_kernels, int8_kernels, route_cache
from kvserve.model.int8_kernels import FloatKernel, Int8Kernel, KernelChoice
from kvserve.model.linear import Int8Linear, Linear
from kvserve.model.probe_shapes import FIXED


class Exact(Int8Kernel):
    """Right answers, any CPU."""

    name = "exact"

    def pack(self, weight):
        return weight.t()

    def matmul(self, x, packed):
        return (x.long() @ packed.long()).float()


class OtherExact(Exact):
    name = "other exact"


@pytest.fixture
def route_file(monkeypatch, tmp_path):
    path = tmp_path / "cache" / route_cache.FILE_NAME
    monkeypatch.setattr(route_cache, "route_file", lambda: path)
    return path


@pytest.fixture
def int8_probes(monkeypatch):
    """The int8 probe, counted: it picks the first kernel, 2x float32 at one token."""
    calls = []

    def probe(kernels, shapes):
        calls.append(kernels)
        return KernelChoice(kernels[0], {1: 2.0, 64: 1.5})

    monkeypatch.setattr(int8_kernels, "probe_kernels", probe)
    return calls


def test_a_remembered_int8_route_is_used_without_probing(route_file, int8_probes):
    kernels = (OtherExact(), Exact())
    first = int8_kernels.remembered_or_probed(kernels)
    assert len(int8_probes) == 1 and "probed now: 2.0x float32 at 1 token" in first.describe()
    again = int8_kernels.remembered_or_probed(kernels)
    assert len(int8_probes) == 1 and again.kernel is kernels[0] and again.speedup_by_rows == {1: 2.0, 64: 1.5}
    assert f"remembered from the probe of {again.probed_at}: 2.0x float32" in again.describe()
    entries = json.loads(route_file.read_text())["entries"]  # JSON, not pickle
    assert entries[route_cache.entry_name("int8", FIXED)]["route"] == "other exact"
    assert route_file.stat().st_mode & 0o777 == 0o600


def test_a_remembered_fallback_names_its_reason(route_file, monkeypatch):
    monkeypatch.setattr(int8_kernels, "probe_kernels", lambda kernels, shapes: KernelChoice(FloatKernel()))
    int8_kernels.remembered_or_probed((Exact(),))
    monkeypatch.setattr(int8_kernels, "probe_kernels", lambda kernels, shapes: pytest.fail("probed again"))
    choice = int8_kernels.remembered_or_probed((Exact(),))
    assert isinstance(choice.kernel, FloatKernel) and "no int8 kernel beat float32 here" in choice.describe()


def test_a_remembered_float_route_is_used_without_probing(route_file, monkeypatch):
    calls = []
    monkeypatch.setattr(float_kernels, "probe_matmuls", lambda dtype, matmuls, shapes: calls.append(dtype) or
                        float_kernels.MatmulChoice(float_kernels.BLAS, dtype))
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        choice = float_kernels.remembered_or_probed(dtype)
    assert calls == [torch.float32, torch.bfloat16]  # one entry per dtype
    assert choice.matmul is float_kernels.BLAS and "remembered from the probe of" in choice.describe()


@pytest.mark.parametrize("change, field", [
    (lambda mp: mp.setattr(route_cache, "cpu_identity", lambda cpu=route_cache.cpu_identity(): {**cpu,
                                                                                                 "flags": ["avx2"]}),
     "cpu"),
    (lambda mp: mp.setattr(torch, "__version__", "0.0.1"), "torch"),
    (lambda mp: mp.setattr(route_cache, "sources_digest", lambda: "edited"), "sources"),
    (lambda mp: mp.setattr(int8_kernels, "PROBE_ROWS", (1, 32)), "probe"),
], ids=["cpu-flag", "torch-version", "source", "probe-rows"])
def test_a_change_of_what_the_choice_depends_on_probes_again(route_file, int8_probes, monkeypatch, caplog, change,
                                                             field):
    kernels = (Exact(),)
    int8_kernels.remembered_or_probed(kernels)
    change(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        choice = int8_kernels.remembered_or_probed(kernels)
    assert len(int8_probes) == 2 and choice.probed_at is None
    assert f"probed under another {field}" in caplog.text
    int8_kernels.remembered_or_probed(kernels)  # rewritten under the new key
    assert len(int8_probes) == 2


def rewrite_entry(path, **fields):
    record = json.loads(path.read_text())
    record["entries"][route_cache.entry_name("int8", FIXED)].update(fields)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("corrupt, why", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "unreadable"),
    (lambda p: p.write_text("[1, 2]"), "not a schema-1 route file"),
    (lambda p: rewrite_entry(p, speedup_by_rows={"1": "fast"}), "speedups of the wrong form"),
    (lambda p: rewrite_entry(p, key=["not", "a", "dict"]), "wrong form"),
    (lambda p: rewrite_entry(p, route="pickle.loads"), "unknown route 'pickle.loads'"),
], ids=["truncated", "not-an-object", "wrong-types", "wrong-key", "unknown-route"])
def test_a_corrupt_file_is_probed_again_and_rewritten(route_file, int8_probes, caplog, corrupt, why):
    kernels = (Exact(),)
    int8_kernels.remembered_or_probed(kernels)
    corrupt(route_file)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert int8_kernels.remembered_or_probed(kernels).probed_at is None
    assert len(int8_probes) == 2 and why in caplog.text
    assert int8_kernels.remembered_or_probed(kernels).probed_at is not None and len(int8_probes) == 2


def test_a_remembered_kernel_that_fails_its_check_is_probed_again(route_file, int8_probes):
    int8_kernels.remembered_or_probed((Exact(),))

    class Broken(Exact):
        def matmul(self, x, packed):
            return super().matmul(x, packed) + 1

    assert int8_kernels.remembered_or_probed((Broken(),)).probed_at is None and len(int8_probes) == 2


@pytest.mark.parametrize("foreign", ["writable-by-others", "owned-by-another"])
def test_a_file_that_is_not_this_users_own_is_ignored_and_left_alone(route_file, int8_probes, monkeypatch, caplog,
                                                                     foreign):
    kernels = (Exact(),)
    int8_kernels.remembered_or_probed(kernels)
    if foreign == "writable-by-others":
        route_file.chmod(0o666)
    else:
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    written = route_file.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert int8_kernels.remembered_or_probed(kernels).probed_at is None
    assert len(int8_probes) == 2 and route_file.read_bytes() == written
    assert ("may be written by other users" if foreign == "writable-by-others" else "belongs to another user") \
        in caplog.text


def test_the_routes_are_kept_beside_the_saved_graphs():
    assert route_cache.DIRECTORY_NAME == saved_graphs.DIRECTORY_NAME


def test_saved_graphs_are_named_by_the_routes_their_layers_run():
    weight = torch.randn(8, 16)
    keys = {saved_graphs.GraphKey.of(Int8Linear(weight, kernel=kernel)).digest
            for kernel in (Exact(), OtherExact(), FloatKernel())}
    assert len(keys) == 3

    class OtherMatmul(float_kernels.BlasMatmul):
        name = "other"

    float_keys = {saved_graphs.GraphKey.of(Linear(weight, matmul=m)).digest for m in (float_kernels.BLAS, OtherMatmul())}
    assert len(float_keys) == 2


@pytest.mark.parametrize("environment", [None, "cache-here"])
def test_the_cache_root_is_inductors_without_importing_inductor(monkeypatch, tmp_path, environment):
    """Found as Inductor finds it (an eager start does not import Inductor: that costs seconds)."""
    from torch._inductor.runtime import cache_dir_utils

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache-here"))  # restored after the test
    if environment is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with monkeypatch.context() as patch:
        patch.delitem(sys.modules, "torch._inductor.runtime.cache_dir_utils")
        found = route_cache.cache_root()
    assert found == Path(cache_dir_utils.cache_dir())
