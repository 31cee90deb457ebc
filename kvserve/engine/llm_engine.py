"""The engine: requests in, one step at a time (schedule -> forward -> sample -> update blocks), outputs out."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from kvserve.config import EngineConfig
from kvserve.engine import startup
from kvserve.engine.builder import build_engine, cache_facts
from kvserve.engine.denormals import flushed_denormals
from kvserve.engine.grammar_masks import MaskWorker
from kvserve.engine.prompts import PromptType, parse_prompt
from kvserve.engine.python_stack import with_stack_headroom
from kvserve.engine.request import Request
from kvserve.engine.sampler import sample
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.engine.structured import Grammar, GrammarCompiler
from kvserve.engine.stats import (
    freed_block_stats,
    pool_stats,
    prefix_cache_stats,
    sliding_window_stats,
    state_stats,
)
from kvserve.engine.validation import checked_params
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvserve")
DISK_LOAD_WAIT_S = 0.05  # an idle step waits at most this long for a prefix read from disk (requests may arrive)


class LLMEngine:
    """Requests in, steps, outputs out; its parts are built by engine/builder.py."""

    def __init__(self, config: EngineConfig):
        self.config = config
        parts = build_engine(config)
        setup, self.validator, self.sequence_factory = parts.setup, parts.validator, parts.sequence_factory
        self.model_name, self.model_path, self.model_config = setup.model_name, setup.model_path, setup.model_config
        self.max_model_len, self.layout, self.eviction = setup.max_model_len, setup.layout, setup.eviction
        self.cache_plan, self.eos_token_ids = setup.cache_plan, self.sequence_factory.eos_token_ids
        self.tokenizer, self.max_prompt_chars = self.validator.tokenizer, self.validator.max_prompt_chars
        self.longest_token_chars = self.validator.longest_token_chars
        self.model, self.cache, self.disk_cache, self.kv = parts.model, parts.cache, parts.disk_cache, parts.kv
        self.scores, self.speculator = parts.scores, parts.speculator
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.num_prefill_tokens = self.num_decode_tokens = 0
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self.num_constrained_requests = self.num_grammar_cache_hits = self.num_invalid_constrained_outputs = 0
        self._grammars_lock = threading.Lock()
        self._mask_worker: MaskWorker | None = None  # started at the first step that samples a constrained sequence
        self._on_cpu = torch.device(config.device).type == "cpu"

    def capacity_line(self) -> str:
        """The start-up line: the pool the planner sized, its storage format and layer groups (as they are now)."""
        return startup.capacity_line(cache_facts(self.cache_plan, self.cache, self.layout, self.config.max_num_seqs))

    # ---- requests in -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> Request:
        """Validate and queue a request; raises ValueError naming the problem, queueing nothing."""
        params = checked_params(params)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parsed = parse_prompt(prompt)
        token_ids = parsed.token_ids if parsed.token_ids is not None else self.encode(parsed.text,
                                                                                      parsed.add_special_tokens)
        max_tokens = self.validator.check_lengths(token_ids, params)
        grammar = self.grammar(params.structured_outputs) if params.structured_outputs is not None else None
        if grammar is not None:  # a grammar an earlier request had compiled is a hit of the grammar cache
            self.num_constrained_requests += 1
            self.num_grammar_cache_hits += grammar.num_requests > 0
            grammar.num_requests += 1
        request = Request(request_id, parsed.text, list(token_ids), params, grammar=grammar)
        seq = self.sequence_factory.new(request, 0, list(token_ids), max_tokens, parsed.cache_salt)
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """`spec` compiled (engine/structured.py), from the cache after the first time; a ValueError names what is
        wrong with it. Thread-safe: the server compiles off the engine thread before queueing the request."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.eos_token_ids)
        return self._grammars.compile(spec)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids. It only reads the tokenizer, so the server calls it off the engine thread.
        A prompt a chat template rendered already holds its special tokens: add_special_tokens=False."""
        return self.validator.encode(text, add_special_tokens)

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text prompt too long for max_model_len tokens by its length alone, without tokenizing it."""
        self.validator.check_prompt_chars(num_chars)

    def check_prompt_length(self, num_tokens: int) -> None:
        """Refuse an empty prompt or one longer than max_model_len (reads only max_model_len)."""
        self.validator.check_prompt_length(num_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks go back to the pool. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish("abort")
            self.scheduler.finish(seq)
        request.metrics.finished_time = time.time()
        output = self._built_output(request)
        output.finished = True
        return output

    def fork_request(self, request_id: str, new_request_id: str, last_token_id: int | None = None) -> Request:
        """Start `new_request_id` as a copy of running one-sequence request `request_id` that shares all its KV
        blocks (copy-on-write). `last_token_id` replaces the copy's newest, not yet computed token and must be
        one of that step's reported logprobs alternatives. Beam search forks beams so; abort_request drops them."""
        parent_request = self.requests.get(request_id)
        parent = parent_request.sequences[0] if parent_request and len(parent_request.sequences) == 1 else None
        if parent is None or parent.status is not SequenceStatus.RUNNING or parent.num_uncomputed_tokens != 1:
            raise ValueError(f"request {request_id!r} is not a running one-sequence request between decode steps")
        if new_request_id in self.requests:
            raise ValueError(f"request_id {new_request_id!r} is already in use")
        request = self.sequence_factory.fork(parent_request, new_request_id, last_token_id)
        self.kv.fork(parent, request.sequences[0])
        self.scheduler.add_running(request.sequences[0], after=parent)
        self.requests[new_request_id] = request
        return request

    def take_prompt_logprobs(self, request_id: str) -> torch.Tensor:
        """The [n, vocab] prompt log-probability rows of a prompt_logprobs=-1 request computed since the last call,
        handed over and dropped from the request, so a text too long to hold its rows can be scored as it runs."""
        seq = self.requests[request_id].sequences[0]
        if seq.params.prompt_logprobs != -1:
            raise ValueError(f"request {request_id!r} did not ask for prompt_logprobs=-1")
        rows, seq.prompt_logprobs = seq.prompt_logprobs, []
        return torch.cat(rows) if rows else torch.empty(0, self.model_config.vocab_size)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once over the whole batch, sample, and return outputs of requests that moved.
        A failure in one request's own work (its prompt logprobs, forking its n samples, sampling, detokenizing,
        stop checks, building its output) fails that request alone (finish_reason "error"); only a failure of
        the shared schedule or forward pass raises."""
        return with_stack_headroom(self._step)  # the same frame-stack room at every step (engine/python_stack.py)

    def _step(self) -> list[RequestOutput]:
        # denormals flushed on the thread that runs the step and its OpenMP team, as they were after it
        with flushed_denormals() if self._on_cpu else contextlib.nullcontext():
            return self._scheduled_step()

    def _scheduled_step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.seqs:
            self.kv.wait_for_loads(DISK_LOAD_WAIT_S)  # only prefixes loading from disk: wait, not spin
            return []
        self._count_tokens(out)
        with self._masks_ahead(out):  # the constrained sequences' next masks, computed while the forward runs
            return self._run(out)

    def _masks_ahead(self, out: SchedulerOutput) -> contextlib.AbstractContextManager:
        """Start the next-token masks of the constrained sequences that sample this step (engine/grammar_masks.py);
        the returned context waits for them at its exit, so none outlives the step."""
        matchers = [seq.grammar for seq, n in zip(out.seqs, out.num_new_tokens)
                    if seq.grammar is not None and seq.num_computed_tokens + n >= len(seq.token_ids)]
        if not matchers:
            return contextlib.nullcontext()
        if self._mask_worker is None:
            self._mask_worker = MaskWorker()
        return self._mask_worker.start(matchers)

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Run the model over the scheduled batch, sample, and return the outputs of the requests that moved."""
        started = time.perf_counter()
        step = self.runner.run(out)
        if self.disk_cache is not None and out.admitted:  # prefill's speed: what reading from disk competes with
            self.disk_cache.note_prefill(out.num_tokens, time.perf_counter() - started)
        logits, seqs = step.logits, step.seqs
        self.scheduler.advance(out)
        touched: dict[str, Request] = {}
        for seq, prompt_logits in step.prompt_logits:
            self._guarded(self.requests[_request_id(seq)], touched, seq.record_prompt_logprobs,
                          torch.log_softmax(prompt_logits, dim=-1))
        drops = self.eviction.evicts or self.layout.windows != (None,)
        if drops:  # a drafted sequence's after its draft is verified, below: rejected tokens are never scored
            for seq in self.scheduler.running:
                if seq.request_id not in out.drafts:
                    self.kv.drop_unneeded(seq, self.scores)
        logits, seqs = self._fork_for_n(logits, seqs, touched)
        samples = _sample_rows(logits, seqs, self.generator)
        now = time.time()
        for seq, sampled in zip(seqs, samples):
            request = self.requests[_request_id(seq)]
            touched[request.request_id] = request
            if request.error is None:
                self._append(request, seq, sampled, now)
        for seq, rows in step.draft_logits:
            request = self.requests[_request_id(seq)]
            touched[request.request_id] = request
            if request.error is None:
                self._verify(request, seq, rows, out.drafts[seq.request_id], now)
            if drops and any(s is seq for s in self.scheduler.running):
                self.kv.drop_unneeded(seq, self.scores)
        return [self._output(request, now) for request in touched.values()]

    def _verify(self, request: Request, seq: Sequence, logits: torch.Tensor, draft: list[int], now: float) -> None:
        """Speculative decoding (engine/speculative.py): take the accepted draft tokens and the one sampled after
        them, then roll the K/V (and a hybrid model's state) back to the accepted tokens."""
        request.metrics.first_token_time = request.metrics.first_token_time or now
        last = seq.num_computed_tokens  # the position of the last token, computed this step with the draft
        try:
            samples, num_accepted = self.speculator.sample_drafted(logits, seq, draft, self.generator)
            num_appended = _append_until_finished(seq, samples)
            self.num_decode_tokens += num_appended
            # valid K/V: the last token and the accepted drafts that were kept (a stop may end the sequence sooner)
            self.scheduler.accept(seq, last + 1 + min(num_accepted, num_appended))
            self.runner.keep_drafted_state(seq)  # hybrid models: the linear layers' state rolls back with it
        except Exception as exc:
            self._fail_request(request, exc)
            return
        if seq.is_finished:
            self.scheduler.finish(seq)

    def _guarded(self, request: Request, touched: dict[str, Request], work, *args) -> None:
        """Run `work(*args)`, one request's own work; if it raises, that request alone fails (and is output)."""
        if request.error is not None:
            return
        try:
            work(*args)
        except Exception as exc:
            self._fail_request(request, exc)
            touched[request.request_id] = request

    def _append(self, request: Request, seq: Sequence, sampled: tuple | Exception, now: float) -> None:
        # Before the token is taken: a request that fails on its first token still had one sampled for it.
        request.metrics.first_token_time = request.metrics.first_token_time or now
        try:
            if isinstance(sampled, Exception):
                raise sampled
            seq.append_token(*sampled)
        except Exception as exc:
            self._fail_request(request, exc)
            return
        if seq.is_finished:
            self.scheduler.finish(seq)

    def _fail_request(self, request: Request, exc: Exception) -> None:
        """Finish every sequence of `request` with finish_reason "error" and free its blocks; the others go on."""
        logger.error(f"request {request.request_id!r} failed: {type(exc).__name__}: {exc}", exc_info=exc)
        request.error = f"{type(exc).__name__}: {exc}"
        for seq in request.sequences:
            if not seq.is_finished:
                seq.finish("error")
            self.scheduler.finish(seq)

    def _count_tokens(self, out: SchedulerOutput) -> None:
        now = time.time()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.request_id in out.drafts:  # counted once verified: the tokens it keeps (_verify)
                continue
            is_decode = n == 1 and seq.num_output_tokens > 0 and seq not in out.admitted
            if is_decode:
                self.num_decode_tokens += n
            else:
                self.num_prefill_tokens += n
        for seq in out.admitted:
            request = self.requests[_request_id(seq)]
            request.metrics.first_scheduled_time = request.metrics.first_scheduled_time or now
            if seq.index == 0 and seq.num_preemptions == 0:
                request.num_cached_tokens = seq.num_computed_tokens
                request.num_disk_cached_tokens = self.kv.disk_hit_tokens(seq, seq.num_computed_tokens)

    def _fork_for_n(self, logits: torch.Tensor, seqs: list[Sequence],
                    failed: dict[str, Request]) -> tuple[torch.Tensor, list[Sequence]]:
        """Each row's sequence, plus the n-1 new siblings of an n>1 request whose prompt was just computed (they
        sample from the same logits). A request whose fork fails is failed, added to `failed`, and left out."""
        rows, expanded = [], []
        for row, seq in enumerate(seqs):
            siblings = []
            request = self.requests[_request_id(seq)]
            if request.error is not None:  # failed earlier in this step: it samples nothing
                continue
            if seq.params.n > 1 and not seq.forked:
                try:
                    siblings = self._fork_samples(request, seq)
                except Exception as exc:
                    self._fail_request(request, exc)
                    failed[request.request_id] = request
                    continue
            for each in [seq, *siblings]:
                rows.append(row)
                expanded.append(each)
        return (logits if rows == list(range(len(seqs))) else logits[rows]), expanded

    def _fork_samples(self, request: Request, seq: Sequence) -> list[Sequence]:
        """After its prompt is computed once, sample 0 of an n>1 request gets n-1 siblings: as many as there are
        free sequence slots share its blocks and sample now; the rest wait for a slot like any sequence (and find
        the prompt's full blocks in the prefix cache)."""
        seq.forked = True
        siblings = []
        num_forked = min(seq.params.n - 1, self.scheduler.free_slots)
        for index in range(1, seq.params.n):
            child = self.sequence_factory.new(request, index, list(seq.token_ids), seq.max_tokens, seq.cache_salt)
            child.forked = True
            request.sequences.append(child)  # first: if what follows fails, failing the request frees the child
            if index > num_forked:
                self.scheduler.add_sibling(child, of=seq)
                continue
            child.num_computed_tokens = seq.num_computed_tokens
            self.kv.fork(seq, child)
            self.scheduler.add_running(child, after=seq)
            siblings.append(child)
        return siblings

    def _output(self, request: Request, now: float) -> RequestOutput:
        output = self._built_output(request)
        if request.finished:
            request.metrics.finished_time = now
            del self.requests[request.request_id]
            # a constrained output that stopped where its grammar does not accept (should stay 0: the masks end it
            # only where the grammar does; a stop string or token can cut it short); max_tokens cut-offs are not
            # counted (finish_reason "length")
            self.num_invalid_constrained_outputs += sum(
                seq.grammar is not None and seq.finish_reason == "stop" and not seq.grammar.is_accepting
                for seq in request.sequences)
        return output

    def _built_output(self, request: Request) -> RequestOutput:
        """request.to_output(); if building it raises, the request fails alone and gets an output without text."""
        try:
            return request.to_output()
        except Exception as exc:
            self._fail_request(request, exc)
            return request.failed_output()

    # ---- what the cache holds ----------------------------------------------------------------------------
    def kv_cache_info(self) -> dict[str, str]:
        """How the cache stores and keeps tokens, as labels (the server's kvserve:kv_cache_info metric)."""
        config = self.config
        return {"kv_cache_dtype": config.kv_cache_format, "format": self.cache.describe(),
                "block_size": str(self.kv.block_size), "layout": self.layout.describe() or "one group of every layer",
                "kv_eviction": config.kv_eviction}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so the next requests compute their prompts in full (benchmarks: each timed
        run starts cold). False, and nothing changes, while requests hold blocks."""
        return self.kv.pool.reset_prefix_cache()

    def stats(self) -> dict[str, float | int]:
        """Counts from each part: the KV cache manager's (engine/stats.py; a hybrid model's state slots too), the
        disk tier's, the speculator's, the scheduler's and the engine's own tokens."""
        live, windows = self.scheduler.running, self.layout.windows
        disk = self.disk_cache.stats() if self.disk_cache is not None else {}
        spec = self.speculator.stats.as_dict() if self.speculator is not None else {}
        tokens = {"num_prefill_tokens": self.num_prefill_tokens, "num_decode_tokens": self.num_decode_tokens}
        grammars = self._grammars
        tokens["num_grammars_compiled"] = grammars.num_compiled if grammars is not None else 0
        tokens["grammar_compile_seconds"] = grammars.compile_seconds if grammars is not None else 0.0
        tokens.update(num_constrained_requests=self.num_constrained_requests,
                      num_grammar_cache_hits=self.num_grammar_cache_hits,
                      num_invalid_constrained_outputs=self.num_invalid_constrained_outputs)
        return {**sliding_window_stats(self.kv, live, windows), **disk, **spec, **pool_stats(self.kv, live, windows),
                **self.scheduler.stats(), **freed_block_stats(self.kv), **tokens, **prefix_cache_stats(self.kv),
                **state_stats(self.kv)}


def _request_id(seq: Sequence) -> str:
    return seq.request_id.rsplit("#", 1)[0] if seq.index else seq.request_id


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> list[tuple | Exception]:
    """(token id, logprob, top logprobs) per row, or the exception that row's request raised."""
    try:
        result = sample(logits, seqs, generator)
    except Exception:
        # One request's parameters broke the batched sampler: sample row by row so only that request fails.
        return [_sample_row(logits[i : i + 1], seq, generator) for i, seq in enumerate(seqs)]
    return list(zip(result.token_ids, result.logprobs, result.top_logprobs))


def _sample_row(logits: torch.Tensor, seq: Sequence, generator: torch.Generator) -> tuple | Exception:
    try:
        result = sample(logits, [seq], generator)
    except Exception as exc:
        return exc
    return result.token_ids[0], result.logprobs[0], result.top_logprobs[0]


def _append_until_finished(seq: Sequence, samples: list[tuple]) -> int:
    """Append the samples in order until one finishes the sequence; returns how many were appended."""
    num_appended = 0
    for sampled in samples:
        seq.append_token(*sampled)
        num_appended += 1
        if seq.is_finished:
            break
    return num_appended
