"""remember_vec_isa_probe: Inductor's per-start ISA probe is answered from a record keyed by the machine, written
when every ISA loaded; a failed ISA, a changed key, a user's setting or a broken record fall back to probing."""
import json

import pytest
import torch
from torch._inductor import config

from kvserve import inductor_isa


class FakeISA:
    def __init__(self, name: str, valid: bool):
        self.name, self.valid, self.probes = name, valid, 0

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:  # Inductor's probe: a child process that loads a library built for this ISA
        self.probes += 1
        return self.valid


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Fake ISAs and a record in tmp_path; Inductor's vec_isa_ok restored after the test."""
    isas = [FakeISA("avx512", True), FakeISA("avx2", True)]
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(inductor_isa.sys, "platform", "linux")
    monkeypatch.setattr(inductor_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(inductor_isa, "_allowed_isas", lambda: isas)
    monkeypatch.setattr(inductor_isa, "_record_path", lambda: tmp_path / inductor_isa.RECORD_NAME)
    return isas, tmp_path / inductor_isa.RECORD_NAME


def test_the_first_start_probes_and_records_then_a_later_start_does_not_probe(machine):
    isas, record = machine
    assert inductor_isa.remember_vec_isa_probe() is True
    assert config.cpp.vec_isa_ok is True
    assert [isa.probes for isa in isas] == [1, 1]
    assert list(json.loads(record.read_text()).values()) == [True]

    config.cpp.vec_isa_ok = None  # a new process
    assert inductor_isa.remember_vec_isa_probe() is True
    assert config.cpp.vec_isa_ok is True
    assert [isa.probes for isa in isas] == [1, 1]  # answered from the record


def test_an_isa_that_fails_its_probe_leaves_inductor_probing_at_every_start(machine):
    isas, record = machine
    isas[0].valid = False
    for _ in range(2):
        assert inductor_isa.remember_vec_isa_probe() is False
        assert config.cpp.vec_isa_ok is None
    assert isas[0].probes == 2
    assert list(json.loads(record.read_text()).values()) == [False]


def test_another_machine_key_probes_again(machine, monkeypatch):
    isas, record = machine
    inductor_isa.remember_vec_isa_probe()
    config.cpp.vec_isa_ok = None
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # torch upgraded
    inductor_isa.remember_vec_isa_probe()
    assert isas[0].probes == 2
    assert len(json.loads(record.read_text())) == 2


def test_a_users_vec_isa_ok_is_left_alone(machine):
    isas, record = machine
    config.cpp.vec_isa_ok = False
    assert inductor_isa.remember_vec_isa_probe() is None
    assert config.cpp.vec_isa_ok is False
    assert isas[0].probes == 0 and not record.exists()


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"key": "yes"}', ""])
def test_a_broken_record_is_probed_again_and_rewritten(machine, content):
    isas, record = machine
    record.write_text(content)
    assert inductor_isa.remember_vec_isa_probe() is True
    assert isas[0].probes == 1
    assert list(json.loads(record.read_text()).values()) == [True]


def test_the_key_names_this_machines_isas_compiler_and_torch():
    import platform
    import sys

    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("Inductor probes vector ISAs on x86 Linux only")
    allowed = inductor_isa._allowed_isas()
    key = inductor_isa._fingerprint(allowed)
    assert "avx2" in key.split(" | ")[0].split(",")  # every x86-64 kvserve runs on has AVX2
    assert torch.__version__ in key and sys.version.split()[0] in key
