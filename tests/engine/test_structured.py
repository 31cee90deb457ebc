"""Structured outputs in the engine (kvserve/engine/structured.py, the sampler's mask, the sequence's matcher): on a
tiny random model with SmolLM2's tokenizer, so the text is gibberish but every constrained output must parse and
validate, whatever the model prefers."""

import json
import re

import jsonschema
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.structured import allowed_tokens, grammar_bitmask, mask_disallowed_
from kvserve.sampling_params import StructuredOutputsParams
from tests.conftest import make_tiny_chat_model

ENGINE_OPTIONS = dict(kv_cache_memory="64MiB", max_model_len=1024)
SCHEMAS = {
    "nested object": {"type": "object", "required": ["user"], "additionalProperties": False, "properties": {
        "user": {"type": "object", "required": ["name", "age"], "additionalProperties": False, "properties": {
            "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}},
    "array of enums": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    "pattern and bounds": {"type": "object", "required": ["code", "level"], "additionalProperties": False,
                           "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                          "level": {"type": "integer", "minimum": 3, "maximum": 7}}},
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_chat_model(tmp_path_factory.mktemp("structured") / "tiny-chat")), **ENGINE_OPTIONS)


def constrained(seed: int, max_tokens: int = 120, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def assert_pool_empty(llm):
    stats = llm.engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    outputs = llm.generate(["Give me JSON:"] * 3, [constrained(seed, json=schema) for seed in range(3)])
    for output in outputs:
        choice = output.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)
    assert_pool_empty(llm)


def test_regex_choice_and_schema_text(llm):
    params = [constrained(1, regex=r"[0-9]{3}-[a-z]{2}"), constrained(2, choice=["yes", "no", "maybe so"]),
              constrained(3, json=json.dumps(SCHEMAS["array of enums"]))]
    texts = [o.outputs[0].text for o in llm.generate(["Answer:"] * 3, params)]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0])
    assert texts[1] in ("yes", "no", "maybe so")
    jsonschema.validate(json.loads(texts[2]), SCHEMAS["array of enums"])


def test_json_object_masks_follow_the_grammar_token_by_token(llm):
    """Any JSON object has unbounded strings, which a random model rarely closes: the mask is checked along a
    known document instead, and the model's output only for its opening."""
    tokenizer, eos = llm.engine.tokenizer, min(llm.engine.eos_token_ids)
    matcher = llm.engine.grammar(StructuredOutputsParams(json_object=True)).new_matcher()
    vocab = llm.engine.model_config.vocab_size
    for token_id in tokenizer('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False).input_ids:
        allowed = allowed_tokens([matcher], vocab)[0]
        assert allowed[token_id] and not allowed[eos] and allowed.sum() < vocab
        matcher.accept(token_id)
    assert matcher.is_finished and allowed_tokens([matcher], vocab)[0].nonzero().flatten().tolist() == [eos]
    rejected = allowed_tokens([llm.engine.grammar(StructuredOutputsParams(json_object=True)).new_matcher()], vocab)
    assert not rejected[0, tokenizer("hello", add_special_tokens=False).input_ids[0]]
    output = llm.generate("x", constrained(0, max_tokens=4, json_object=True))[0].outputs[0]
    assert output.text.startswith("{") and output.finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra_tokens", [0, 40, -8])
def test_the_packed_mask_blocks_what_the_unpacked_one_blocks(llm, extra_tokens):
    """mask_disallowed_ (the sampler's) sets -inf exactly where allowed_tokens is False, also past the tokenizer's
    words (a model whose vocabulary is padded: blocked) and on a vocabulary shorter than the words."""
    tokenizer = llm.engine.tokenizer
    matchers = [llm.engine.grammar(StructuredOutputsParams(json=SCHEMAS[name])).new_matcher() for name in SCHEMAS]
    matchers[0].accept(tokenizer('{"', add_special_tokens=False).input_ids[0])
    vocab = llm.engine.model_config.vocab_size + extra_tokens
    logits = torch.randn(len(matchers), vocab)
    expected = logits.masked_fill(~allowed_tokens(matchers, vocab), float("-inf"))
    masked = mask_disallowed_(logits.clone(), grammar_bitmask(matchers))
    assert masked.equal(expected) and bool((masked > float("-inf")).any(dim=1).all())
    if extra_tokens > 0:
        assert bool((masked[:, -extra_tokens:] == float("-inf")).all())


def test_constrained_request_leaves_its_batch_unchanged(tmp_path):
    """Unconstrained rows sample exactly what they sample alone; the constrained one still validates. The engine is
    batch-invariant, so "exactly" holds by the code's guarantee on every CPU, not by one BLAS's rounding."""
    llm = LLM(str(make_tiny_chat_model(tmp_path / "tiny-chat")), **ENGINE_OPTIONS, batch_invariant=True)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "JSON please:"]
    alone = llm.generate(prompts[:2], greedy)
    mixed = llm.generate(prompts, [greedy, greedy, constrained(0, json=SCHEMAS["nested object"])])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMAS["nested object"])


def test_n_samples_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=120, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["pattern and bounds"]))
    output = llm.generate("Codes:", params)[0]
    assert len(output.outputs) == 3
    for choice in output.outputs:
        jsonschema.validate(json.loads(choice.text), SCHEMAS["pattern and bounds"])
        assert len(choice.logprobs) == len(choice.token_ids)
        assert all(token in top for token, top in zip(choice.token_ids, choice.logprobs))
    assert_pool_empty(llm)


def test_max_tokens_cuts_the_output_with_finish_reason_length(llm):
    whole = llm.generate("x", constrained(7, json=SCHEMAS["nested object"]))[0].outputs[0]
    cut = llm.generate("x", constrained(7, max_tokens=3, json=SCHEMAS["nested object"]))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3
    assert whole.token_ids[:3] == cut.token_ids  # what was generated so far, the same draws


def test_grammars_are_cached_by_spec(llm):
    before = llm.engine.stats()
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    llm.generate(["a", "b"], [constrained(0, json=schema), constrained(1, json=json.dumps(schema))])
    after = llm.engine.stats()
    assert after["num_grammars_compiled"] == before["num_grammars_compiled"] + 1  # the second found it cached
    assert after["num_constrained_requests"] == before["num_constrained_requests"] + 2
    assert after["num_grammar_cache_hits"] == before["num_grammar_cache_hits"] + 1
    assert after["grammar_compile_seconds"] > before["grammar_compile_seconds"]


def test_invalid_constrained_outputs_are_counted(llm):
    """The masks end an output only where its grammar accepts (none counted); a stop string that cuts one short
    is counted, and a max_tokens cut-off is not (finish_reason "length" says it)."""
    before = llm.engine.stats()["num_invalid_constrained_outputs"]
    whole = llm.generate("x", constrained(7, json=SCHEMAS["nested object"]))[0].outputs[0]
    assert whole.finish_reason == "stop" and llm.engine.stats()["num_invalid_constrained_outputs"] == before
    llm.generate("x", constrained(7, max_tokens=3, json=SCHEMAS["nested object"]))
    assert llm.engine.stats()["num_invalid_constrained_outputs"] == before
    params = constrained(7, json=SCHEMAS["nested object"])
    params.stop = ['"user"']  # cut right after the opening brace
    cut = llm.generate("x", params)[0].outputs[0]
    assert cut.finish_reason == "stop" and llm.engine.stats()["num_invalid_constrained_outputs"] == before + 1


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_specs_are_refused_by_name(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", constrained(0, **spec))
    assert not llm.engine.has_unfinished_requests()


def test_structured_outputs_params_take_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_speculative_engine_skips_drafts_for_constrained_sequences(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-chat")
    llm = LLM(str(model), **ENGINE_OPTIONS, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    llm.engine.speculator.lookup = lambda seq, limit: [5] * limit  # a random model never repeats itself: always draft
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(["a b", "c d"], [plain, constrained(0, json=SCHEMAS["array of enums"])])
    assert outputs[0].num_draft_tokens > 0
    jsonschema.validate(json.loads(outputs[1].outputs[0].text), SCHEMAS["array of enums"])
    assert outputs[1].num_draft_tokens == 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_drafts_are_cut_at_the_grammar_and_verified_under_its_masks(tmp_path, temperature):
    """Speculative decoding on a constrained request: a draft keeps only what the grammar takes (an invalid token
    ends it), each verification row is masked as of the drafts before it, and the output equals the undrafted
    one, token for token (greedy, and sampled with a seed: a row's mask and distribution are the same)."""
    model = make_tiny_chat_model(tmp_path / "tiny-chat")
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested object"]))
    undrafted = LLM(str(model), **ENGINE_OPTIONS).generate(["Give me JSON:"], params)[0].outputs[0]
    answer = list(undrafted.token_ids)
    llm = LLM(str(model), **ENGINE_OPTIONS, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    proposed = []
    invalid = llm.engine.tokenizer.encode("\n", add_special_tokens=False)[0]  # a raw newline: never valid JSON here

    def lookup(seq, limit):  # the answer's next tokens, then one the grammar cannot take there
        draft = (answer[seq.num_output_tokens : seq.num_output_tokens + 2] + [invalid])[:limit]
        proposed.append(draft)
        return draft
    llm.engine.speculator.lookup = lookup
    drafted = llm.generate(["Give me JSON:"], params)[0].outputs[0]
    assert drafted.token_ids == answer and drafted.text == undrafted.text
    jsonschema.validate(json.loads(drafted.text), SCHEMAS["nested object"])
    stats = llm.engine.speculator.stats
    assert proposed and stats.num_accepted_tokens > 0  # drafts were verified and taken
    assert stats.num_draft_tokens < sum(len(d) for d in proposed)  # the invalid tokens were never verified
    assert_pool_empty(llm)
