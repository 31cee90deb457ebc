"""Masks computed ahead (kvserve/engine/grammar_masks.py): equal to the ones a matcher computes alone, used only for
the state they were computed for, detached when the step ends whatever happens in it, and a failure in the worker
or in one grammar fails at most that request, never the batch, never a hang. Matchers follow real JSON documents
with SmolLM2's tokenizer; the engine tests run a tiny random model that speaks it."""

import contextlib
import json
import threading

import jsonschema
import pytest
import transformers

from kvserve import LLM, SamplingParams
from kvserve.engine.grammar_masks import MaskWorker
from kvserve.engine.structured import GrammarCompiler, allowed_tokens
from kvserve.model.loader import resolve_model
from kvserve.sampling_params import StructuredOutputsParams
from tests.conftest import make_tiny_chat_model

SCHEMA = {"type": "object", "required": ["name", "tags"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}}}}
DOCUMENTS = [{"name": "Ada", "tags": ["a", "ccc"]}, {"name": "x y z", "tags": []}, {"name": "", "tags": ["bb"] * 3}]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)


@pytest.fixture(scope="module")
def grammar(tokenizer):
    return GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id})).compile(StructuredOutputsParams(json=SCHEMA))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_chat_model(tmp_path_factory.mktemp("masks") / "tiny-chat")), kv_cache_memory="64MiB",
               max_model_len=512)


class NoOwnMasks:
    """A matcher's llguidance matcher that refuses to compute a mask itself (everything else passes through)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def unsafe_compute_mask_ptr(self, *args):
        raise RuntimeError("this grammar is broken")

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def streams(tokenizer) -> list[list[int]]:
    return [tokenizer(json.dumps(d, separators=(", ", ": ")), add_special_tokens=False).input_ids for d in DOCUMENTS]


def test_masks_computed_ahead_equal_the_ones_computed_alone(tokenizer, grammar):
    worker, vocab = MaskWorker(2), len(tokenizer)
    ahead, alone = [grammar.new_matcher() for _ in DOCUMENTS], [grammar.new_matcher() for _ in DOCUMENTS]
    tokens = streams(tokenizer)
    for step in range(max(map(len, tokens))):
        live = [i for i, stream in enumerate(tokens) if step < len(stream)]
        with worker.start([ahead[i] for i in live]) as masks:
            assert masks.wait()
            for i in live:  # the rows must come from the worker: the matchers cannot compute their own now
                ahead[i].llmatcher = NoOwnMasks(ahead[i].llmatcher)
            got = allowed_tokens([ahead[i] for i in live], vocab)
            for i in live:
                ahead[i].llmatcher = ahead[i].llmatcher.matcher
        assert got.equal(allowed_tokens([alone[i] for i in live], vocab))
        assert got[list(range(len(live))), [tokens[i][step] for i in live]].all()
        assert all(matcher.ahead is None for matcher in ahead)  # detached at the end of the step
        for i in live:
            ahead[i].accept(tokens[i][step])
            alone[i].accept(tokens[i][step])


def test_a_mask_computed_before_a_token_was_taken_is_not_used(tokenizer, grammar):
    stream = streams(tokenizer)[0]
    matcher, reference = grammar.new_matcher(), grammar.new_matcher()
    with MaskWorker(1).start([matcher]) as masks:
        assert masks.wait()
        matcher.accept(stream[0])
        reference.accept(stream[0])
        assert allowed_tokens([matcher], len(tokenizer)).equal(allowed_tokens([reference], len(tokenizer)))
    assert not allowed_tokens([grammar.new_matcher()], len(tokenizer)).equal(allowed_tokens([reference],
                                                                                           len(tokenizer)))


def test_a_failing_worker_leaves_the_masks_to_the_matchers(tokenizer, grammar, caplog):
    worker = MaskWorker(1)
    worker.fill = lambda matchers, bitmask: 1 / 0
    matchers = [grammar.new_matcher() for _ in range(2)]
    with worker.start(matchers) as masks:
        assert not masks.wait()
        got = allowed_tokens(matchers, len(tokenizer))
    assert got.equal(allowed_tokens([grammar.new_matcher() for _ in range(2)], len(tokenizer)))
    assert "grammar masks computed ahead failed (ZeroDivisionError" in caplog.text


def constrained(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=SCHEMA))


def assert_pool_empty(llm):
    stats = llm.engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_the_engine_samples_the_same_tokens_with_masks_ahead_or_not(llm, monkeypatch):
    prompts, params = ["a", "b", "c"], [constrained(1), SamplingParams(temperature=0, max_tokens=8), constrained(2)]
    with_ahead = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine._mask_worker is not None  # the masks were computed ahead
    started = []

    def none_ahead(self, out):
        started.append(out)
        return contextlib.nullcontext()

    monkeypatch.setattr(type(llm.engine), "_masks_ahead", none_ahead)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert started and with_ahead == alone
    for tokens in (with_ahead[0], with_ahead[2]):
        jsonschema.validate(json.loads(llm.engine.tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


def test_a_broken_grammar_fails_its_request_alone(llm):
    engine = llm.engine
    broken = engine.add_request("broken", "a", constrained(3))
    engine.add_request("fine", "b", constrained(4))
    engine.add_request("plain", "c", SamplingParams(temperature=0, max_tokens=5))
    broken.sequences[0].grammar.llmatcher = NoOwnMasks(broken.sequences[0].grammar.llmatcher)  # worker's too
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs["broken"].outputs[0].finish_reason == "error"
    assert "this grammar is broken" in outputs["broken"].error
    jsonschema.validate(json.loads(outputs["fine"].outputs[0].text), SCHEMA)
    assert outputs["plain"].outputs[0].finish_reason == "length"
    assert_pool_empty(llm)


def test_a_step_that_fails_while_masks_compute_leaves_none_running(llm, monkeypatch):
    """The forward raises while the worker is still computing: the step waits for it and detaches the masks, so the
    request can be aborted (the engine thread aborts between steps) with nothing left behind."""
    engine = llm.engine
    request = engine.add_request("doomed", "a", constrained(5))
    engine.step()  # prefill: from now on its mask is computed ahead
    computing, release = threading.Event(), threading.Event()
    worker = engine._mask_worker
    fill = worker.fill
    monkeypatch.setattr(worker, "fill", lambda *args: (computing.set(), release.wait(10), fill(*args)))

    def failing_forward(out):
        computing.wait(10)
        threading.Timer(0.05, release.set).start()  # the worker ends only after the step has begun to unwind
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(engine.runner, "run", failing_forward)
    with pytest.raises(RuntimeError, match="the forward failed"):
        engine.step()
    assert release.is_set() and request.sequences[0].grammar.ahead is None
    engine.abort_request("doomed")
    assert_pool_empty(llm)
    monkeypatch.undo()
    jsonschema.validate(json.loads(llm.generate("b", constrained(6))[0].outputs[0].text), SCHEMA)

