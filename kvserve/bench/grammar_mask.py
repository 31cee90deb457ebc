"""Per-token cost of a grammar library's allowed-token mask, and which JSON-schema features it compiles, with the
embedded SmolLM2 tokenizer: `python -m kvserve.bench.grammar_mask` (docs/server.md, "Structured outputs").

Each schema's example document is tokenized and fed through a fresh matcher; every step computes the mask and
then takes the example's next token, so the timing covers real positions inside strings, numbers and keys.
xgrammar is measured only when it is installed (kvserve depends on llguidance alone)."""
from __future__ import annotations

import json
import statistics
import time

SCHEMAS = {
    "flat object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    "nested, arrays, enums, bounds": ({
        "type": "object", "required": ["id", "tags", "address", "status", "score"],
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{4}$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "address": {"type": "object", "required": ["city", "zip"],
                        "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
            "status": {"enum": ["active", "suspended", "closed"]},
            "score": {"type": "number", "minimum": 0, "maximum": 100}}},
        {"id": "abc-1234", "tags": ["alpha", "beta gamma"], "address": {"city": "Paris", "zip": 75001},
         "status": "active", "score": 87.5}),
}
FEATURES = {  # one schema per feature, for the coverage table
    "pattern": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "minimum / maximum": {"type": "integer", "minimum": 1, "maximum": 9},
    "enum": {"enum": ["a", "b"]},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "$ref / $defs": {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
    "recursive $ref": {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array",
                       "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"},
    "minItems / maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "minLength / maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "not": {"not": {"type": "string"}},
    "if / then": {"if": {"type": "string"}, "then": {"minLength": 2}},
}


def llguidance_library(hf_tokenizer):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    from kvserve.engine.structured import JSON_OPTIONS as options

    def compile_(schema):
        source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if is_error:
            raise ValueError(messages[0])
        return lambda: llguidance.LLMatcher(tokenizer, source, log_level=0)

    def step(matcher, token_id):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        assert matcher.consume_token(token_id), matcher.get_error()

    return compile_, step


def xgrammar_library(hf_tokenizer):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile_(schema):
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(", ", ": "))
        return lambda: xgrammar.GrammarMatcher(compiled)

    def step(matcher, token_id):
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(token_id)

    return compile_, step


def measure(name, make_library, hf_tokenizer) -> None:
    try:
        compile_, step = make_library(hf_tokenizer)
    except ImportError:
        print(f"{name}: not installed")
        return
    for label, (schema, example) in SCHEMAS.items():
        started = time.perf_counter()
        new_matcher = compile_(schema)
        compile_ms = (time.perf_counter() - started) * 1e3
        token_ids = hf_tokenizer(json.dumps(example), add_special_tokens=False).input_ids
        times = []
        for _ in range(5):
            matcher = new_matcher()
            for token_id in token_ids:
                started = time.perf_counter()
                step(matcher, token_id)
                times.append(time.perf_counter() - started)
        times.sort()
        print(f"{name:10} | {label:30} | compile {compile_ms:7.1f} ms | mask+advance per token: mean "
              f"{sum(times) / len(times) * 1e6:5.0f} us, median {times[len(times) // 2] * 1e6:5.0f} us, max "
              f"{times[-1] * 1e6:6.0f} us ({len(token_ids)} tokens x 5)")
    supported = []
    for feature, schema in FEATURES.items():
        try:
            compile_(schema)
            supported.append(feature)
        except Exception as exc:  # each library's own error type
            print(f"{name:10} | refuses {feature}: {str(exc).splitlines()[0][:100]}")
    print(f"{name:10} | compiles {len(supported)}/{len(FEATURES)} features: {', '.join(supported)}")


def measure_sampler_batch(hf_tokenizer, batch_size: int = 32, repeats: int = 20) -> None:
    """What kvserve's sampler spends masking a batch of `batch_size` rows of which some are constrained (each row
    midway through the nested schema's example), against none: the mask alone, not the draw; with the masks computed
    at sampling, and with them computed ahead as the engine does (engine/grammar_masks.py: the sampling's part)."""
    import torch

    from kvserve.engine.grammar_masks import MaskWorker
    from kvserve.engine.sampler import _apply_grammars
    from kvserve.engine.structured import GrammarCompiler
    from kvserve.sampling_params import StructuredOutputsParams

    schema, example = SCHEMAS["nested, arrays, enums, bounds"]
    grammar = GrammarCompiler(hf_tokenizer, frozenset({hf_tokenizer.eos_token_id})).compile(
        StructuredOutputsParams(json=schema))
    prefix = hf_tokenizer(json.dumps(example), add_special_tokens=False).input_ids[:20]
    logits, worker = torch.randn(batch_size, len(hf_tokenizer)), MaskWorker()
    for num_constrained in (0, 1, 8, batch_size // 2, batch_size):
        rows = [_Row(None) for _ in range(batch_size)]
        for row in rows[:num_constrained]:
            row.grammar = grammar.new_matcher()
            for token_id in prefix:
                row.grammar.accept(token_id)
        at_sampling, ahead = [], []
        for _ in range(repeats):
            at_sampling.append(_timed(_apply_grammars, logits, rows))
            if num_constrained:
                with worker.start([row.grammar for row in rows[:num_constrained]]) as masks:
                    masks.wait()  # the forward runs here in the engine
                    ahead.append(_timed(_apply_grammars, logits, rows))
        print(f"sampler   | {batch_size} rows, {num_constrained:2} constrained | masking, median of {repeats}: "
              f"{statistics.median(at_sampling) * 1e3:6.2f} ms a step"
              + (f", with the masks computed ahead {statistics.median(ahead) * 1e3:6.2f} ms" if ahead else ""))


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


class _Row:
    def __init__(self, grammar):
        self.grammar = grammar


def main() -> None:
    import transformers

    from kvserve.model.loader import resolve_model

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(None).path)
    print(f"tokenizer: embedded SmolLM2, {len(hf_tokenizer)} tokens")
    measure("llguidance", llguidance_library, hf_tokenizer)
    measure("xgrammar", xgrammar_library, hf_tokenizer)
    measure_sampler_batch(hf_tokenizer)


if __name__ == "__main__":
    main()
