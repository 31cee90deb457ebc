"""The engine's C-heap settings: applied once on glibc, and not at all where the environment configures malloc."""
import logging
import platform

import pytest

from kvserve.engine import heap
from tests.conftest import make_tiny_model, save_char_tokenizer


@pytest.fixture
def unset(monkeypatch):
    """keep_freed_heap as if no engine had started in this process, with no malloc variables set."""
    for name in list(heap.os.environ):
        if name == "GLIBC_TUNABLES" or name.startswith("MALLOC_"):
            monkeypatch.delenv(name)
    heap.keep_freed_heap.cache_clear()
    yield
    heap.keep_freed_heap.cache_clear()


@pytest.fixture
def fresh(unset, monkeypatch):
    """As `unset`, with a stand-in libc that records each mallopt call (returned)."""
    calls = []
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda _: _FakeLibc(calls))
    return calls


class _FakeLibc:
    def __init__(self, calls, accept=True):
        self.calls, self.accept = calls, accept

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return int(self.accept)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_glibc_keeps_large_blocks_on_the_heap_once_per_process(fresh):
    line = heap.keep_freed_heap()
    assert line.startswith("C heap: freed memory kept for the next step")
    assert fresh == [(heap.M_MMAP_THRESHOLD, 32 * 2**20), (heap.M_TRIM_THRESHOLD, 2**30)]
    assert heap.keep_freed_heap() == line and len(fresh) == 2  # a second engine changes nothing


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
@pytest.mark.parametrize("variable", ["GLIBC_TUNABLES", "MALLOC_ARENA_MAX"])
def test_malloc_set_by_the_environment_is_left_alone(fresh, monkeypatch, variable):
    monkeypatch.setenv(variable, "glibc.malloc.arena_max=2" if variable == "GLIBC_TUNABLES" else "2")
    assert heap.keep_freed_heap() == f"C heap: left as the environment sets it ({variable})"
    assert fresh == []


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_a_refused_setting_is_reported(fresh, monkeypatch):
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda _: _FakeLibc(fresh, accept=False))
    assert heap.keep_freed_heap() == "C heap: glibc refused mallopt, left as it is"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_this_glibc_accepts_both_settings(unset):
    """The real mallopt, not a stand-in, takes both values (it returns 0 for a setting it refuses)."""
    assert heap.keep_freed_heap().startswith("C heap: freed memory kept for the next step")


def test_engine_start_up_says_what_it_did_with_the_heap(tmp_path, caplog):
    from kvserve import LLM

    model_dir = save_char_tokenizer(make_tiny_model(tmp_path))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        LLM(str(model_dir), max_model_len=64, kv_cache_memory="1MiB")
    assert any(r.getMessage().startswith("C heap: ") for r in caplog.records)


def test_other_c_libraries_are_left_alone(fresh, monkeypatch):
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("", ""))
    assert heap.keep_freed_heap() == "C heap: not glibc, left as it is" and fresh == []
