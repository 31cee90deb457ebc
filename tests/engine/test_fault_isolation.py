"""A request that fails inside a step fails alone: it finishes with finish_reason "error" and its blocks go back,
while a request batched with it gets exactly the tokens it gets alone. If a step itself raises, the offline LLM
aborts that call's requests, so the next call works (n=1 and n>1, Ctrl-C included)."""
import threading

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import Detokenizer
from tests.conftest import make_tiny_model, save_char_tokenizer

GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_char_tokenizer(make_tiny_model(tmp_path_factory.mktemp("faults"), "llama-gqa"))


@pytest.fixture
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=128)


@pytest.fixture(scope="module")
def alone(model_dir) -> list[int]:
    """The good request's tokens when it runs by itself."""
    llm = LLM(str(model_dir), kv_cache_memory="1MiB", max_model_len=128)
    return llm.generate("good prompt", GOOD)[0].outputs[0].token_ids


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def assert_failed_alone(llm: LLM, outputs, alone: list[int], words: str) -> None:
    good, bad = outputs
    assert good.outputs[0].token_ids == alone and good.outputs[0].finish_reason == "length"
    assert bad.finished and words in bad.error
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    assert_idle(llm)
    assert llm.generate("good prompt", GOOD)[0].outputs[0].token_ids == alone  # and the engine goes on


def test_a_request_whose_sampling_fails_fails_alone(llm, alone):
    bad = SamplingParams(temperature=1.0, max_tokens=8)
    bad.top_k = 2**70  # past validation: the batched sampler's int64 tensor cannot hold it
    outputs = llm.generate(["good prompt", "bad prompt"], [GOOD, bad])
    assert_failed_alone(llm, outputs, alone, "Overflow")


def test_a_request_whose_detokenizer_fails_fails_alone(llm, alone, monkeypatch):
    update = Detokenizer.update

    def failing_update(self, token_ids):
        if "BOOM" in self.stop and len(token_ids) == 3:
            raise RuntimeError("injected detokenizer fault")
        update(self, token_ids)

    monkeypatch.setattr(Detokenizer, "update", failing_update)
    bad = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["BOOM"])
    outputs = llm.generate(["good prompt", "bad prompt"], [GOOD, bad])
    assert_failed_alone(llm, outputs, alone, "injected detokenizer fault")
    assert len(outputs[1].outputs[0].token_ids) == 3  # it stopped where it failed


def test_a_failed_fork_of_n_samples_fails_that_request_and_frees_every_sibling(llm, alone, monkeypatch):
    fork = llm.engine.kv.fork

    def failing_fork(parent, child):
        if child.request_id.endswith("#2"):  # the first sibling was already forked: it holds blocks too
            raise RuntimeError("injected fork fault")
        fork(parent, child)

    monkeypatch.setattr(llm.engine.kv, "fork", failing_fork)
    bad = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1)
    outputs = run_with_deadline(lambda: llm.generate(["good prompt", "bad prompt"], [GOOD, bad]))
    assert_failed_alone(llm, outputs, alone, "injected fork fault")


def run_with_deadline(call, timeout_s: float = 60.0):
    """call(), failing the test (not hanging it) if it never returns, as generate once spun after a failed fork."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert result, f"still running after {timeout_s} s"
    return result[0]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("fault", [RuntimeError("injected step fault"), KeyboardInterrupt()])
def test_llm_recovers_after_a_step_raises(llm, monkeypatch, n, fault):
    params = SamplingParams(n=n, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    expected = [c.token_ids for c in llm.generate("recover", params)[0].outputs]
    run = llm.engine.runner.run
    calls = []

    def failing_run(out):
        calls.append(out)
        if len(calls) == 2:  # the first decode: the n>1 request has forked its siblings by then
            raise fault
        return run(out)

    monkeypatch.setattr(llm.engine.runner, "run", failing_run)
    with pytest.raises(type(fault)):
        llm.generate(["recover", "another"], params)
    assert_idle(llm)
    again = run_with_deadline(lambda: llm.generate("recover", params))
    assert [c.token_ids for c in again[0].outputs] == expected


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_a_tiny_temperature_is_greedy(llm, temperature):
    # logits / 1e-40 overflows float32: it once gave NaN probabilities and token 0 forever
    tiny = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
    assert llm.generate("good prompt", tiny)[0].outputs[0].token_ids == llm.generate("good prompt", GOOD)[0].outputs[0].token_ids


def test_text_too_long_for_max_model_len_is_refused_without_tokenizing(llm, monkeypatch):
    tokenizer_type = type(llm.tokenizer)
    calls = []
    monkeypatch.setattr(tokenizer_type, "__call__", lambda self, *args, **kwargs: calls.append(args))
    limit = llm.engine.max_prompt_chars
    assert limit == 128 * 5  # max_model_len x the char tokenizer's longest token, "<pad>"
    with pytest.raises(ValueError, match=rf"the prompt has 5,000,000 characters, more than max_model_len=128 "
                                         rf"tokens can hold \(at most {limit:,}"):
        llm.generate("x" * 5_000_000)
    assert calls == []
    assert_idle(llm)


def test_text_that_is_not_unicode_is_refused(llm):
    with pytest.raises(ValueError, match="not valid Unicode text"):
        llm.generate("a lone \ud800 surrogate")
    assert_idle(llm)
