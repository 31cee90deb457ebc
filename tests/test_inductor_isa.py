"""remember_vec_isa_probe: Inductor's per-start ISA probe is answered from a record keyed by the machine, written
when every ISA loaded; a failed ISA, a changed key, a user's setting or a broken record fall back to probing."""
import json

import pytest
import torch
from torch._inductor import config, cpu_vec_isa

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
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", FakeLoads())
    return isas, tmp_path / inductor_isa.RECORD_NAME


class FakeLoads:
    """Inductor's child process that loads a library built for an ISA extension: succeeds where `fails` says not."""

    def __init__(self):
        self.loads, self.fails = [], set()

    def __call__(self, isa, output_path: str) -> bool:
        self.loads.append(output_path)
        return output_path not in self.fails


def test_extension_libraries_that_loaded_are_not_loaded_again_by_a_later_start(machine, tmp_path, monkeypatch):
    isas, record = machine
    fake = cpu_vec_isa.VecISA._probe_load
    libraries = [tmp_path / "bf16.so", tmp_path / "vnni.so", tmp_path / "broken.so"]
    for library in libraries:
        library.write_bytes(b"")
    fake.fails.add(str(libraries[2]))
    inductor_isa.remember_vec_isa_probe()
    for library in libraries:  # the first start: each loaded in a child, as Inductor does
        cpu_vec_isa.VecISA._probe_load(isas[0], str(library))
    assert len(fake.loads) == 3

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", fake)  # a new process: torch's own method again
    config.cpp.vec_isa_ok = None
    inductor_isa.remember_vec_isa_probe()
    results = [cpu_vec_isa.VecISA._probe_load(isas[0], str(library)) for library in libraries]
    assert results == [True, True, False]
    assert fake.loads[3:] == [str(libraries[2])]  # only the one that failed is loaded again
    libraries[0].unlink()  # a recorded library gone (a cleared cache): loaded again, as Inductor would after building
    cpu_vec_isa.VecISA._probe_load(isas[0], str(libraries[0]))
    assert fake.loads[4:] == [str(libraries[0])]


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


def test_the_libraries_a_first_probe_loads_are_recorded_with_its_answer(machine, tmp_path):
    """The first start's own probe loads each ISA's libraries in child processes: those are recorded too, so the
    next start loads none (Inductor's extension checks run again in every new process)."""
    isas, record = machine
    library = tmp_path / "avx512_bf16.so"
    library.write_bytes(b"")
    fake = cpu_vec_isa.VecISA._probe_load
    isas[0].__class__ = type("ExtendedISA", (FakeISA,), {
        "__bool__": lambda self: cpu_vec_isa.VecISA._probe_load(self, str(library)) and FakeISA.__bool__(self)})
    assert inductor_isa.remember_vec_isa_probe() is True
    assert fake.loads == [str(library)]
    assert sum(value is True for value in json.loads(record.read_text()).values()) == 2  # the answer, the library
    assert cpu_vec_isa.VecISA._probe_load(isas[0], str(library)) is True and fake.loads == [str(library)]
