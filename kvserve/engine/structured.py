"""Grammar-constrained decoding (structured outputs) over llguidance: a request's constraint compiled once per
distinct spec (cached), one matcher per sequence, and the allowed-token masks the sampler applies to constrained
rows. Why llguidance, and its per-token mask cost here: docs/server.md, "Structured outputs"."""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from kvserve.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept by spec (an agent's tool list repeats every turn)
# JSON without optional whitespace: a model cannot spend its tokens on blank runs, and the output is compact.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarMatcher:
    """One sequence's place in its grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int):
        self.llmatcher, self.num_words = matcher, num_words
        self.num_accepted = 0  # tokens taken: a mask computed ahead is for one count
        self.ahead: tuple[Any, int, int] | None = None  # (MasksAhead, its row, num_accepted) (engine/grammar_masks.py)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; a token the mask allowed is always accepted."""
        if not self.llmatcher.consume_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}: {self.llmatcher.get_error()}")
        self.num_accepted += 1

    def valid_draft(self, draft: list[int], eos_token_ids: frozenset[int]) -> list[int]:
        """The longest start of a speculative draft that this grammar takes from here, before any end token (the
        sequence would end there): what is worth verifying."""
        for i, token_id in enumerate(draft):
            if token_id in eos_token_ids:
                draft = draft[:i]
                break
        return draft[: self.llmatcher.validate_tokens(draft)] if draft else draft

    def draft_masks(self, draft: list[int]) -> torch.Tensor:
        """[len(draft) + 1, num_words] int32: the next token's mask here (fill), then after each token of a draft
        that valid_draft gave; the matcher is rolled back to where it was."""
        masks = torch.empty(len(draft) + 1, self.num_words, dtype=torch.int32)
        self.fill(masks[0])
        consumed = 0
        try:
            for j, token_id in enumerate(draft):
                if not self.llmatcher.consume_token(token_id):
                    raise RuntimeError(f"the grammar rejected drafted token {token_id}: {self.llmatcher.get_error()}")
                consumed += 1
                self.llmatcher.unsafe_compute_mask_ptr(masks[j + 1].data_ptr(), self.num_words * 4)
        finally:
            if consumed:
                self.llmatcher.rollback(consumed)
        return masks

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and takes nothing more (only an end-of-sequence token)."""
        return self.llmatcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The tokens taken so far are a whole output of the grammar (it may take more)."""
        return self.llmatcher.is_accepting()

    def fill(self, bitmask_row: torch.Tensor) -> None:
        """The next token's mask into `bitmask_row` (num_words int32): the one computed ahead for this state if
        there is one, else computed now."""
        if self.ahead is not None:
            masks, row, num_accepted = self.ahead
            computed = masks.row(row)  # waits for it: the matcher is not touched while the worker may read it
            if computed is not None and num_accepted == self.num_accepted:
                bitmask_row.copy_(computed)
                return
        self.llmatcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), self.num_words * 4)


class Grammar:
    """A compiled constraint: each sequence gets its own copy of the matcher at the start."""

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int):
        self._matcher, self._num_words = matcher, num_words
        self.num_requests = 0  # requests constrained by it (LLMEngine.add_request: grammar cache hits)

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self._num_words)


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the latest MAX_CACHED_GRAMMARS by spec; thread-safe, so the
    server compiles off the engine thread and the engine finds the grammar cached."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]):
        if tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this engine has none")
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_token_ids) or None)
        self.vocab_size = self._tokenizer.vocab_size
        self._num_words = (self.vocab_size + 31) // 32
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_seconds = 0.0  # spent compiling the grammars not found in the cache

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The spec's grammar, compiled or from the cache; a ValueError names what is wrong with the spec."""
        key = _cache_key(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        started = time.perf_counter()
        grammar = Grammar(self._matcher(spec), self._num_words)
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - started
            self._cache[key] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        source = grammar_source(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self._tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {_clean(messages[0])}")
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} cannot be compiled: {_clean(matcher.get_error())}")
        return matcher


def grammar_source(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the spec (a ValueError for a schema that is not JSON)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(_schema(spec.json), defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def grammar_bitmask(matchers: list[GrammarMatcher]) -> torch.Tensor:
    """[len(matchers), num_words] int32: bit j of word w is set where token 32w + j may come next."""
    bitmask = torch.empty(len(matchers), matchers[0].num_words, dtype=torch.int32)  # each fill writes its whole row
    for row, matcher in zip(bitmask, matchers):
        matcher.fill(row)
    return bitmask


def unpacked(bitmask: torch.Tensor, vocab_size: int, past_words: bool = False) -> torch.Tensor:
    """[rows, vocab_size] bool of the bits (tokens past the words read `past_words`)."""
    # bit j of word w is token 32w + j: the words' bytes little-endian, each byte's bits lowest first
    words = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    bits = torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little")).view(torch.bool)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.cat([bits, bits.new_full((len(bits), vocab_size - bits.shape[1]), past_words)], dim=1)


def allowed_tokens(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: the tokens each matcher allows next (none past the tokenizer's words)."""
    return unpacked(grammar_bitmask(matchers), vocab_size)


def mask_disallowed_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with the tokens `bitmask` (grammar_bitmask) does not allow set to -inf, in place: the
    bits are inverted while packed (a word per 32 tokens) and unpacked once, into the mask masked_fill_ takes."""
    return logits.masked_fill_(unpacked(~bitmask, logits.shape[1], past_words=True), float("-inf"))


def _schema(schema: str | dict) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    return schema


def _cache_key(spec: StructuredOutputsParams) -> str:
    value = _schema(spec.json) if spec.kind == "json" else getattr(spec, spec.kind)
    return spec.kind + ":" + json.dumps(value, sort_keys=True)


def _clean(message: str) -> str:
    return message.removeprefix("ERROR: ").strip()
