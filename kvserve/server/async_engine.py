"""The engine behind the HTTP server: one thread owns the (not thread-safe) engine and steps it while there is
work; handlers on the asyncio loop hand it commands through a thread-safe queue and get outputs back in an
OutputSink per HTTP request."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.prompts import PromptType
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvserve")
DEFAULT_MAX_WAITING = 256  # sequences queued for the engine before a new request gets 503 (n=4 counts 4)

StepObserver = Callable[[list[RequestOutput], float], None]


class EngineDeadError(RuntimeError):
    """The engine raised inside a step (its requests are lost) or is shutting down: it takes no more."""


class RequestFailedError(RuntimeError):
    """A request failed inside the engine (finish_reason "error"); the engine serves the others on."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (counted in sequences); the request was not queued."""

    def __init__(self, num_waiting: int):
        super().__init__(f"{num_waiting} sequences are already waiting")
        self.num_waiting = num_waiting


class OutputSink:
    """Where the outputs of one HTTP request's engine requests land (on the loop's thread). Outputs are
    cumulative, so only the latest of each request is kept: a client that stops reading holds one output per
    request, not one per step."""

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest[output.request_id] = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def take(self) -> list[RequestOutput]:
        """The latest output of every request that moved since the last take (waits for one); raises the
        engine's failure."""
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        latest, self._latest = self._latest, {}
        return list(latest.values())


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    pass


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future


class _Stop:
    pass


class AsyncEngine:
    """Runs `engine` in a background thread; call `add_request` and `abort` from the loop that called `start`."""

    def __init__(self, engine: LLMEngine, max_waiting: int, observer: StepObserver | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._observer = observer or (lambda outputs, now: None)
        self._commands: queue.Queue[_Add | _Abort | _AbortAll | _Call | _Stop] = queue.Queue()
        self._outputs: dict[str, OutputSink] = {}  # touched only on the loop's thread
        self._adds_in_flight: set[asyncio.Future] = set()  # sent to the engine thread, unanswered (loop thread)
        self._calls_in_flight: set[asyncio.Future] = set()  # likewise, for `call`
        # Admission counting, in sequences (a request with n samples counts n), on the loop's thread: those let
        # in but not sent yet (their prompts are being tokenized), and those of _Add commands sent. The engine
        # thread publishes its stats together with the sequences of the _Add commands it has applied, so each
        # is counted once: in flight, or in the engine's queue.
        self._num_reserved = 0
        self._num_adds_sent = 0
        self._num_adds_applied = 0  # engine thread
        self._snapshot: tuple[dict[str, Any], int] = (engine.stats(), 0)  # replaced (never mutated) by it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Prompts are tokenized (and chat templates rendered) here, never on the engine thread or the loop: one
        # thread, so a flood of long prompts costs the engine at most one core's share.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenize")
        self.error: str | None = None  # why it takes no more requests, once it does not

    # ---- on the event loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is still running (its clients get finish_reason "abort") and stop the thread."""
        if self._thread is None:
            return
        self.error = self.error or "the server is shutting down"
        self._commands.put(_Stop())
        self._thread.join(timeout_s)
        self._thread = None
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of its last step (read without touching the engine)."""
        return self._snapshot[0]

    @property
    def num_waiting(self) -> int:
        """Sequences let in and not yet running: reserved, in flight to the engine thread, or in its queue."""
        stats, num_adds_applied = self._snapshot
        return stats["num_waiting"] + self._num_reserved + (self._num_adds_sent - num_adds_applied)

    def reserve(self, num_requests: int, n: int = 1) -> None:
        """Let `num_requests` requests of `n` samples each in, counted as waiting sequences from now on, or raise
        ValueError (more than the queue ever holds), EngineOverloadedError (a full queue) or EngineDeadError.
        Each is then either sent by add_request or handed back by release."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        num_seqs = num_requests * n
        if num_seqs > self.max_waiting:
            asked = f"{num_requests} prompts × n={n} = {num_seqs:,}" if n > 1 else f"{num_requests}"
            raise ValueError(f"the request needs {asked} sequences; this server queues at most {self.max_waiting} "
                             f"(--max-waiting)")
        if self.num_waiting + num_seqs > self.max_waiting:
            raise EngineOverloadedError(self.num_waiting)
        self._num_reserved += num_seqs

    def release(self, num_requests: int, n: int = 1) -> None:
        """Hand back reserved requests that will not be sent (bad prompt, client gone)."""
        self._num_reserved -= num_requests * n

    async def run_in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._loop.run_in_executor(self._tokenizer_thread, fn, *args)

    async def token_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: text is tokenized in the tokenizer thread (after the engine's cheap length
        bound), token ids are checked against max_model_len here. Raises ValueError naming the problem."""
        if isinstance(prompt, str):
            return await self.run_in_tokenizer_thread(self.engine.encode, prompt)
        self.engine.check_prompt_length(len(prompt))  # reads only max_model_len: safe off the engine thread
        return prompt

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          outputs: OutputSink) -> None:
        """Queue a reserved request whose outputs go to `outputs`; raises ValueError (bad input) before anything
        runs."""
        self._num_reserved -= params.n
        if self.error is not None:
            raise EngineDeadError(self.error)
        accepted = self._loop.create_future()
        self._outputs[request_id] = outputs
        self._adds_in_flight.add(accepted)
        self._num_adds_sent += params.n
        self._commands.put(_Add(request_id, prompt, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client went away: the engine may have queued it meanwhile
            self.abort(request_id)
            raise
        except BaseException:
            self._outputs.pop(request_id, None)
            raise
        finally:
            self._adds_in_flight.discard(accepted)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)` run on the engine thread between two steps (to read its live state safely); its result."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        done = self._loop.create_future()
        self._calls_in_flight.add(done)
        self._commands.put(_Call(fn, done))
        try:
            return await done
        finally:
            self._calls_in_flight.discard(done)

    def abort(self, request_id: str) -> None:
        """Stop a request now (its blocks go back to the pool); no more outputs are delivered for it."""
        if self._outputs.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Stop every request now; each gets a last output with finish_reason "abort" (for shutdown)."""
        self._commands.put(_AbortAll())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._outputs.get(output.request_id)
            if sink is None:  # aborted by its handler meanwhile
                continue
            sink.put(output)
            if output.finished:
                del self._outputs[output.request_id]

    def _fail_all(self, error: EngineDeadError) -> None:
        for sink in self._outputs.values():
            sink.fail(error)
        self._outputs.clear()
        for accepted in self._adds_in_flight | self._calls_in_flight:  # the dead thread will never answer them
            _settle(accepted, error)

    # ---- on the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:
            logger.exception("the engine failed; failing all requests")
            self.error = f"it failed with {type(exc).__name__}: {exc}"
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(self.error))

    def _serve(self) -> None:
        while True:
            commands = self._take_commands(block=not self.engine.has_unfinished_requests())
            answers = [self._apply(c) for c in commands if not isinstance(c, _Stop)]
            self._num_adds_applied += sum(c.params.n for c in commands if isinstance(c, _Add))
            self._publish_stats()
            for future, exc in filter(None, answers):
                self._loop.call_soon_threadsafe(_settle, future, exc)
            if any(isinstance(c, _Stop) for c in commands):
                self._abort_all()
                return
            if self.engine.has_unfinished_requests():
                self._step()

    def _take_commands(self, block: bool) -> list[_Add | _Abort | _AbortAll | _Call | _Stop]:
        # Idle: sleep until a command arrives. Busy: take what has arrived and get back to stepping.
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort | _AbortAll | _Call) -> tuple[asyncio.Future, BaseException | None] | None:
        if isinstance(command, _Call):
            self._answer(command)
            return None
        if isinstance(command, _AbortAll):
            self._abort_all()
            return None
        if isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            if output is not None:
                self._observe([output])
            return None
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as exc:  # bad input (ValueError) or a tokenizer error: that request fails, not the engine
            return command.accepted, exc
        return command.accepted, None

    def _answer(self, call: _Call) -> None:
        try:
            result, exc = call.fn(self.engine), None
        except Exception as error:  # the caller's bug, not the engine's: it gets the exception
            result, exc = None, error
        self._loop.call_soon_threadsafe(_settle, call.done, exc, result)

    def _publish_stats(self) -> None:
        self._snapshot = (self.engine.stats(), self._num_adds_applied)

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Feed the metrics; a failure there is logged and costs those outputs' metrics, never the engine thread."""
        try:
            self._observer(outputs, time.time())
        except Exception:
            logger.exception("the metrics observer failed; serving on")

    def _step(self) -> None:
        outputs = self.engine.step()
        self._observe(outputs)
        self._publish_stats()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _abort_all(self) -> None:
        aborted = [self.engine.abort_request(request_id) for request_id in list(self.engine.requests)]
        aborted = [output for output in aborted if output is not None]
        self._observe(aborted)
        self._publish_stats()
        if aborted:
            self._loop.call_soon_threadsafe(self._deliver, aborted)


def _settle(future: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
    if future.done():  # its handler was cancelled while waiting
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


async def updates(outputs: OutputSink, request_ids: list[str]) -> AsyncIterator[list[RequestOutput]]:
    """The outputs of `request_ids` as they come, until all have finished. Each item holds the latest output of
    every request that moved; outputs are cumulative, so when a client falls behind, older ones are skipped."""
    unfinished, errors = set(request_ids), []
    while unfinished:
        batch = await outputs.take()
        for output in batch:
            if output.finished:
                unfinished.discard(output.request_id)
                errors += [output.error] if output.error is not None else []
        yield batch
    if errors:  # after the outputs, so a stream shows the failed choice's finish_reason "error" first
        raise RequestFailedError("; ".join(errors))
