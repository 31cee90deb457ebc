"""The engine: requests in, one step at a time (schedule -> forward -> sample -> update blocks), outputs out."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch

from kvserve.batch_invariant import TILE_ROWS, RowTiles
from kvserve.config import EngineConfig
from kvserve.compile.steps import (WHOLE_GRAPH_KV_BYTES, CompiledDecode, attention_outside, gemms_unused,
                                          unsupported)
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.heap import keep_freed_heap
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.prompts import PromptType, parse_prompt
from kvserve.engine.python_stack import with_stack_headroom
from kvserve.engine.request import Request
from kvserve.engine.sampler import sample
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.engine.speculative import Speculator
from kvserve.kv.disk_cache import DiskBlockStore, DiskKVCache, model_fingerprint
from kvserve.kv.eviction import AttentionScores, make_policy
from kvserve.kv.formats import KVCacheSpec, make_kv_cache
from kvserve.kv.formats.compiled import decode_kind
from kvserve.kv.formats.latent import check_latent_settings
from kvserve.kv.kv_cache_manager import KVCacheManager
from kvserve.model.config import ModelConfig
from kvserve.model.int8_kernels import FloatKernel
from kvserve.model.loader import load_weights, resolve_model
from kvserve.model.registry import MODEL_CLASSES, build_model
from kvserve.outputs import RequestOutput
from kvserve.planner.capacity import KVCachePlan, plan_kv_cache
from kvserve.planner.kv_size import kv_layout
from kvserve.planner.model_spec import ModelSpec
from kvserve.planner.units import format_bytes
from kvserve.sampling_params import SamplingParams, is_text

logger = logging.getLogger("kvserve")
DISK_LOAD_WAIT_S = 0.05  # an idle step waits at most this long for a prefix read from disk (requests may arrive)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source = resolve_model(config.model)
        self.model_name = source.name
        self.model_path = source.path
        hf_config = json.loads((source.path / "config.json").read_text())
        self.model_config = ModelConfig.from_hf(hf_config)
        self.max_model_len = self._max_model_len(config, self.model_config)
        spec = ModelSpec.from_hf_config(hf_config, name=source.name)
        self.layout = kv_layout(spec)
        self.eviction = make_policy(config.kv_eviction, config.kv_sink_tokens, config.kv_recent_tokens,
                                    config.kv_budget_tokens)
        if self.eviction.evicts and self.layout.windows != (None,):
            raise ValueError(f"kv_eviction={config.kv_eviction!r} is not supported with sliding-window models; "
                             "their sliding layers already bound the cache")
        if self.model_config.deepseek is not None:
            check_latent_settings(config.kv_cache_format, config.kv_eviction)
        _check_fits_in_memory(config)
        self.cache_plan: KVCachePlan = plan_kv_cache(
            spec,
            config.kv_cache_memory_bytes,
            config.block_size,
            config.kv_cache_format,
            self.max_model_len,
            config.kv_eviction,
            self.eviction.max_blocks(config.block_size),
        )
        if not self.cache_plan.fits:
            raise ValueError(self.cache_plan.error)
        self.tokenizer = _load_tokenizer(source.path)
        # No tokenization packs more characters into one token than the vocabulary's longest token has, so a
        # text longer than this cannot fit in max_model_len tokens: refused before the tokenizer runs.
        self.longest_token_chars = max(map(len, self.tokenizer.get_vocab())) if self.tokenizer is not None else 0
        # a streaming-evicting engine takes prompts of any length (the server's body cap still bounds them)
        self.max_prompt_chars = (float("inf") if self.eviction.unbounded_length
                                 else self.max_model_len * self.longest_token_chars)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | _generation_eos(source.path)
        mc, plan = self.model_config, self.cache_plan
        if torch.device(config.device).type == "cpu":
            logger.info(keep_freed_heap())  # each step's temporaries live on the C heap
        weights = load_weights(source.path, config.torch_dtype)
        # --compile-decode: why no decode step can run compiled, if none can; else a one-row graph multiplies float
        # weights in loops of its own, over dense weights (model/linear.py)
        self.eager_decode_reason = unsupported(MODEL_CLASSES[mc.architecture], config.batch_invariant,
                                               self.eviction.unbounded_length) if config.compile_decode else None
        self.model = build_model(mc, weights, self.max_model_len, config.torch_dtype, config.device,
                                 config.quantization, config.batch_invariant,
                                 dense_in_graph=config.compile_decode and self.eager_decode_reason is None)
        del weights
        logger.info(self._weights_line())
        model_windows = [mc.sliding_window if t == "sliding_attention" else None for t in mc.layer_types]
        if model_windows != [self.layout.windows[g] for g in self.layout.group_of]:
            raise ValueError(f"{self.model_name}: the model's sliding-window layers {model_windows} disagree with "
                             "the KV layout the planner derived from its config")
        tiles = RowTiles(TILE_ROWS if config.batch_invariant else None)
        # batch-invariant attention reads every format the same way for every query (no compiled decode)
        self.cache = make_kv_cache(KVCacheSpec(config.kv_cache_format, self.layout, plan.num_blocks, plan.block_size,
                                   mc.num_kv_heads, mc.head_dim, config.torch_dtype, config.device, config.max_num_seqs,
                                   compile=not (config.enforce_eager or config.batch_invariant), tiles=tiles,
                                   decode_in_place=config.compile_decode,
                                   latent_rope_dim=mc.deepseek.qk_rope_head_dim if mc.deepseek else None))
        started = time.perf_counter()
        self.cache.warm_up(mc.num_heads)
        compile_seconds = time.perf_counter() - started
        logger.info(self.capacity_line())
        logger.info(self.batch_invariance_line())
        if decode_kind(self.cache.fused_decode) == "compiled":
            logger.info(f"{self.cache.format_name} decode attention compiled in {compile_seconds:.1f} s "
                        "(torch.compile; --enforce-eager skips it)")
        self.disk_cache = self._open_disk_cache(source.path) if config.kv_disk_cache is not None else None
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching,
                                 hash_namespace=config.kv_cache_format, eviction=self.eviction,
                                 windows=self.layout.windows, tile_windows=config.batch_invariant,
                                 disk=self.disk_cache)
        self.scores = (AttentionScores(plan.num_blocks * plan.block_size, plan.block_size, config.device)
                       if self.eviction.needs_attention_scores else None)
        windows = self.layout.windows
        self._full_group = windows.index(None) if None in windows else 0  # whose tokens "num_tokens_stored" counts
        self._sliding_group = next((g for g, w in enumerate(windows) if w is not None), None)
        self.speculator = (Speculator(config.speculative_config, self.cache)
                           if config.speculative_config is not None else None)
        if self.speculator is not None:
            logger.info(self.speculator.describe())
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.speculator)
        self.runner = ModelRunner(self.model, self.cache, self.kv, config.device, self.scores, tiles,
                                  self._compiled_decode())
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

    def _compiled_decode(self) -> CompiledDecode | None:
        """Decode steps as one compiled graph, compiled now (compile/steps.py); None: they run eagerly."""
        config = self.config
        if not config.compile_decode:
            return None
        if self.eager_decode_reason is not None:
            logger.info(f"decode steps: eager ({self.eager_decode_reason})")
            return None
        outside = attention_outside(self.cache, self.eviction.needs_attention_scores)
        gemms = config.compile_gemms
        if gemms and (unused := outside or gemms_unused(self.model)) is not None:
            logger.info(f"--compile-gemms: not applied ({unused}); the decode step compiles without it")
            gemms = False
        compiled = CompiledDecode(self.model, self.cache, gemms=gemms, whole=outside is None)
        if not compiled.warm_up():
            return None
        if outside is None:
            graphs = ("compiled (torch.compile, --compile-decode): one sequence in a whole graph, several in "
                      "another while their K/V padded to the longest is at most "
                      f"{WHOLE_GRAPH_KV_BYTES / 2**20:,.0f} MiB, the others (any number, any context lengths) in one "
                      "with attention outside it")
        else:
            graphs = f"one compiled graph with attention outside it (torch.compile, --compile-decode; {outside})"
        logger.info(f"decode steps: {graphs}, in {compiled.compile_seconds:.1f} s{compiled.compile_phases_line()}"
                    f"{compiled.gemms_line()}; prefill and mixed steps in the graph with attention outside it too")
        return compiled

    def _open_disk_cache(self, model_path: Path) -> DiskKVCache:
        """The disk tier, its records named for everything that decides a block's bytes (kv/disk_cache.py)."""
        config = self.config
        fingerprint = model_fingerprint(
            model_path, kv_cache_format=config.kv_cache_format, block_specs=self.cache.block_specs(),
            block_size=config.block_size, dtype=config.dtype, quantization=config.quantization,
            layout=self.layout, batch_invariant=config.batch_invariant, device=torch.device(config.device).type)
        store = DiskBlockStore(config.kv_disk_cache, config.kv_disk_cache_size_bytes, fingerprint)
        logger.info(store.start_line(config.block_size, self.layout.num_groups))
        return DiskKVCache(store, self.cache)

    def _weights_line(self) -> str:
        """e.g. "weights: 135.5 MB int8 (per-output-channel scales; activations per token)"."""
        if self.config.quantization == "int8":
            form = "int8 (per-output-channel scales, activations quantized per token, both rotated; norms in " \
                   f"{self.config.dtype})"
            if isinstance(kernel := self.model.linears.kernel, FloatKernel):
                form += f"; the codes are held as float32 for the fallback kernel ({kernel.reason})"
            copy = self.model.linears.tied_copy_nbytes
            if copy:
                form += (f"; of which {copy / 1e6:,.1f} MB is the int8 kernel's own copy of the tied embedding table "
                         "(lookups read the codes, the output head its packed copy)")
        else:
            form = self.config.dtype
            linears = self.model.linears
            copies = []
            if linears.tied_copy_nbytes:
                copies.append(f"{linears.tied_copy_nbytes / 1e6:,.1f} MB is {linears.matmul.name}'s packed copy of "
                              "the tied embedding table: lookups read the table, the output head its packed copy")
            if linears.dense_copy_nbytes:
                copies.append(f"{linears.dense_copy_nbytes / 1e6:,.1f} MB the dense weights kept beside "
                              f"{linears.matmul.name}'s packed copies for --compile-decode: the single stream's graph "
                              "multiplies them in loops of its own")
            if copies:
                form += f" (of which {'; '.join(copies)})"
        return f"weights: {self.model.weights_nbytes / 1e6:,.1f} MB {form}"

    def capacity_line(self) -> str:
        """The start-up line: the pool the planner sized, its storage format and layer groups."""
        described = "; ".join(filter(None, [self.cache.describe(), self.layout.describe()]))
        line = self.cache_plan.summary_line(described)
        if self.cache.extra_nbytes:
            line += (f"; plus {self.cache.extra_nbytes / 2**20:.1f} MiB of full-precision staging for partly "
                     f"filled blocks (2 blocks for each of {self.config.max_num_seqs} sequences)")
        return line

    def batch_invariance_line(self) -> str:
        """The start-up line saying which guarantee holds (docs/architecture.md, "Batch invariance")."""
        if self.config.batch_invariant:
            return (f"batch invariance: bitwise (--batch-invariant: every per-token op on tiles of {TILE_ROWS} "
                    f"tokens, attention per {self.config.block_size}-token query tile); a request's logits do not "
                    "depend on its batch, chunking, prefix hits or preemption")
        return ("batch invariance: same greedy tokens batched or alone up to float rounding (a lossy KV format "
                "may flip a near-tie); --batch-invariant makes logits bitwise independent of the batch")

    @staticmethod
    def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}")
        return config.max_model_len

    # ---- requests in -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> Request:
        """Validate and queue a request; raises ValueError naming the problem, queueing nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        parsed = parse_prompt(prompt)
        token_ids = parsed.token_ids if parsed.token_ids is not None else self.encode(parsed.text,
                                                                                      parsed.add_special_tokens)
        max_tokens = self._check_lengths(token_ids, params)
        request = Request(request_id, parsed.text, list(token_ids), params)
        seq = self._new_sequence(request, 0, list(token_ids), max_tokens, parsed.cache_salt)
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids. It only reads the tokenizer, so the server calls it off the engine thread.
        A prompt a chat template rendered already holds its special tokens: add_special_tokens=False."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass prompt_token_ids instead of text")
        self.check_prompt_chars(len(text))
        if not is_text(text):
            raise ValueError("the prompt is not valid Unicode text (it has a lone surrogate)")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text prompt too long for max_model_len tokens by its length alone, without tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"the prompt has {num_chars:,} characters, more than max_model_len={self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_chars:,}: the longest token has {self.longest_token_chars})"
            )

    def check_prompt_length(self, num_tokens: int) -> None:
        """Refuse an empty prompt or one that leaves no room to generate (reads only max_model_len)."""
        if num_tokens == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_tokens >= self.max_model_len and not self.eviction.unbounded_length:
            raise ValueError(f"the prompt has {num_tokens} tokens, but max_model_len={self.max_model_len} leaves no "
                             f"room to generate")

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        self.check_prompt_length(len(token_ids))  # before the per-token check: a huge prompt is refused at once
        prompt_len, limit = len(token_ids), self.max_model_len
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        if self.eviction.unbounded_length:  # positions stay within the cache: only max_tokens bounds the length
            max_tokens = params.max_tokens if params.max_tokens is not None else limit
            return self._check_n_and_stop(params, max_tokens)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"max_tokens={max_tokens} exceeds max_model_len={limit} minus prompt length {prompt_len} "
                f"(at most {limit - prompt_len})"
            )
        return self._check_n_and_stop(params, max_tokens)

    def _check_n_and_stop(self, params: SamplingParams, max_tokens: int) -> int:
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none (use stop_token_ids)")
        return max_tokens

    def _new_sequence(self, request: Request, index: int, token_ids: list[int], max_tokens: int,
                      cache_salt: str | None) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed + index)
        return Sequence(
            request_id=request.request_id if index == 0 else f"{request.request_id}#{index}",
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            detokenizer=Detokenizer(self.tokenizer, list(params.stop), params.skip_special_tokens),
            cache_salt=cache_salt,
            generator=generator,
        )

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
        token_ids, cumulative_logprob = list(parent.token_ids), parent.cumulative_logprob
        if last_token_id is not None:
            alternatives = parent.logprobs[-1] if parent.logprobs and parent.num_output_tokens else {}
            if last_token_id not in alternatives:
                raise ValueError(f"token {last_token_id} is not among the last step's logprobs of {request_id!r}")
            cumulative_logprob += alternatives[last_token_id] - alternatives[token_ids[-1]]
            token_ids[-1] = last_token_id
        request = Request(new_request_id, parent_request.prompt, parent_request.prompt_token_ids, parent.params,
                          num_cached_tokens=parent_request.num_cached_tokens,
                          num_disk_cached_tokens=parent_request.num_disk_cached_tokens,
                          metrics=dataclasses.replace(parent_request.metrics))
        child = self._new_sequence(request, 0, token_ids, parent.max_tokens, parent.cache_salt)
        child.num_computed_tokens = parent.num_computed_tokens
        child.cumulative_logprob = cumulative_logprob
        child.logprobs = list(parent.logprobs) if parent.logprobs is not None else None
        self.kv.fork(parent, child)
        self.scheduler.add_running(child, after=parent)
        request.sequences.append(child)
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
        out = self.scheduler.schedule()
        if not out.seqs:
            self.kv.wait_for_loads(DISK_LOAD_WAIT_S)  # only prefixes loading from disk: wait, not spin
            return []
        self._count_tokens(out)
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
        if self.eviction.evicts or self.layout.windows != (None,):
            for seq in self.scheduler.running:
                self.kv.drop_unneeded(seq, self.scores)
        logits, seqs = self._fork_for_n(logits, seqs, touched)
        samples = self._sample(logits, seqs)
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
        return [self._output(request, now) for request in touched.values()]

    def _verify(self, request: Request, seq: Sequence, logits: torch.Tensor, draft: list[int], now: float) -> None:
        """Speculative decoding (engine/speculative.py): take the accepted draft tokens and the one sampled after
        them, then roll the K/V back to the accepted tokens."""
        request.metrics.first_token_time = request.metrics.first_token_time or now
        last = seq.num_computed_tokens  # the position of the last token, computed this step with the draft
        try:
            samples, num_accepted = self.speculator.sample_drafted(logits, seq, draft, self.generator)
            num_appended = 0
            for sampled in samples:
                seq.append_token(*sampled)
                num_appended += 1
                if seq.is_finished:
                    break
            self.num_decode_tokens += num_appended
            # valid K/V: the last token and the accepted drafts that were kept (a stop may end the sequence sooner)
            self.scheduler.accept(seq, last + 1 + min(num_accepted, num_appended))
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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple | Exception]:
        """(token id, logprob, top logprobs) per row, or the exception that row's request raised."""
        try:
            result = sample(logits, seqs, self.generator)
        except Exception:
            # One request's parameters broke the batched sampler: sample row by row so only that request fails.
            return [self._sample_row(logits[i : i + 1], seq) for i, seq in enumerate(seqs)]
        return list(zip(result.token_ids, result.logprobs, result.top_logprobs))

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> tuple | Exception:
        try:
            result = sample(logits, [seq], self.generator)
        except Exception as exc:
            return exc
        return result.token_ids[0], result.logprobs[0], result.top_logprobs[0]

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
            child = self._new_sequence(request, index, list(seq.token_ids), seq.max_tokens, seq.cache_salt)
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
        pool = self.kv.pool
        live = self.scheduler.running
        queries, hits = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits
        sliding = {}
        if self._sliding_group is not None:  # a sliding layer holds only its window's tokens
            sliding["num_tokens_stored_sliding"] = sum(self.kv.num_stored_tokens(s, self._sliding_group) for s in live)
        disk = self.disk_cache.stats() if self.disk_cache is not None else {}
        spec = {}
        if self.speculator is not None:
            counts = self.speculator.stats
            spec = {"spec_decode_num_drafts": counts.num_drafts, "spec_decode_num_draft_tokens": counts.num_draft_tokens,
                    "spec_decode_num_accepted_tokens": counts.num_accepted_tokens,
                    "spec_decode_accepted_by_position": list(counts.accepted_by_position)}
        return {
            **sliding,
            **disk,
            **spec,
            "num_blocks": pool.num_blocks,
            "block_size": self.kv.block_size,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": pool.num_used_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
            "num_tokens_stored": sum(self.kv.num_stored_tokens(s, self._full_group) for s in live),
            "slot_waste_tokens": sum(self.kv.num_wasted_slots(s) for s in live),
            "num_running": len(live),
            "num_waiting": self.scheduler.num_waiting_seqs,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_evicted_blocks": self.kv.num_evicted_blocks,
            "num_window_blocks_freed": self.kv.num_window_blocks_freed,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        }


def _request_id(seq: Sequence) -> str:
    return seq.request_id.rsplit("#", 1)[0] if seq.index else seq.request_id


def _check_fits_in_memory(config: EngineConfig) -> None:
    """A CPU KV cache larger than the machine's RAM fails late and obscurely (allocator error or OOM kill)."""
    if config.device != "cpu" or "SC_PHYS_PAGES" not in os.sysconf_names:
        return
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if config.kv_cache_memory_bytes > ram_bytes:
        raise ValueError(f"kv_cache_memory={format_bytes(config.kv_cache_memory_bytes)} is more than this machine's "
                         f"memory ({format_bytes(ram_bytes)}); choose a smaller --kv-cache-memory")


def _load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _generation_eos(path: Path) -> frozenset[int]:
    file = path / "generation_config.json"
    if not file.exists():
        return frozenset()
    eos = json.loads(file.read_text()).get("eos_token_id")
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
