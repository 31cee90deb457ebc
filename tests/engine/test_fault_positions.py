"""A request that fails inside a step fails alone at every token it can fail on, the first and the last included,
and in every piece of its own work: sampling a token, recording its prompt logprobs, building its output. Its
neighbour gets exactly its tokens alone, its blocks go back, and the engine serves on (issue 31: a failure on the
first token once left first_token_time unset and killed the server's engine thread)."""
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.request import Request
from kvserve.engine.sequence import Sequence
from tests.conftest import fail_at_token, make_tiny_model, save_char_tokenizer

MAX_TOKENS = 5
GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_char_tokenizer(make_tiny_model(tmp_path_factory.mktemp("fault-positions"), "llama-gqa"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=128)


@pytest.fixture(scope="module")
def alone(llm) -> list[int]:
    return llm.generate("good prompt", GOOD)[0].outputs[0].token_ids


def bad_params(n: int = 1, **extra) -> SamplingParams:
    # "BOOM" marks the request the injected faults pick; the tiny model never writes it
    return SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True, stop=["BOOM"],
                          **extra)


def assert_failed_alone(llm: LLM, outputs, alone: list[int], message: str) -> None:
    good, bad = outputs
    assert good.outputs[0].token_ids == alone and good.outputs[0].finish_reason == "length"
    assert bad.finished and message in bad.error
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    assert bad.metrics.first_token_time is None or bad.metrics.first_token_time >= bad.metrics.arrival_time
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert llm.generate("good prompt", GOOD)[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("position", range(1, MAX_TOKENS + 1))  # 1: the first token, MAX_TOKENS: the last
def test_a_fault_at_any_token_fails_that_request_alone(llm, alone, monkeypatch, position, n):
    fail_at_token(monkeypatch, position)
    outputs = llm.generate(["good prompt", "bad prompt"], [GOOD, bad_params(n)])
    assert_failed_alone(llm, outputs, alone, f"injected fault at token {position}")
    assert outputs[1].metrics.first_token_time is not None  # a token was sampled for it
    assert max(len(c.token_ids) for c in outputs[1].outputs) == position


def test_a_fault_recording_prompt_logprobs_fails_that_request_alone(llm, alone, monkeypatch):
    record = Sequence.record_prompt_logprobs

    def failing_record(self, logprobs):
        if "BOOM" in self.params.stop:
            raise RuntimeError("injected prompt logprobs fault")
        record(self, logprobs)

    monkeypatch.setattr(Sequence, "record_prompt_logprobs", failing_record)
    outputs = llm.generate(["good prompt", "bad prompt"], [GOOD, bad_params(prompt_logprobs=2)])
    assert_failed_alone(llm, outputs, alone, "injected prompt logprobs fault")
    assert outputs[1].outputs[0].token_ids == []  # it failed before sampling


@pytest.mark.parametrize("position", [1, MAX_TOKENS])
def test_a_fault_building_the_output_fails_that_request_alone(llm, alone, monkeypatch, position):
    to_output = Request.to_output

    def failing_to_output(self):
        if "BOOM" in self.params.stop and max(len(s.output_token_ids) for s in self.sequences) == position:
            raise RuntimeError("injected output fault")
        return to_output(self)

    monkeypatch.setattr(Request, "to_output", failing_to_output)
    outputs = llm.generate(["good prompt", "bad prompt"], [GOOD, bad_params()])
    assert_failed_alone(llm, outputs, alone, "injected output fault")
    assert len(outputs[1].outputs[0].token_ids) == position
