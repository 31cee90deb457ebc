"""The engine behind the HTTP server: one thread owns the (not thread-safe) engine and steps it while there is
work; handlers on the asyncio loop hand it commands through a thread-safe queue and get outputs back on
asyncio queues."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.prompts import PromptType
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvserve")
DEFAULT_MAX_WAITING = 256  # requests queued for the engine before a new one gets 503

StepObserver = Callable[[list[RequestOutput], float], None]


class EngineDeadError(RuntimeError):
    """The engine raised inside a step (its requests are lost) or is shutting down: it takes no more."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the request was not queued."""

    def __init__(self, num_waiting: int):
        super().__init__(f"{num_waiting} requests are already waiting")
        self.num_waiting = num_waiting


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
        self._outputs: dict[str, asyncio.Queue] = {}  # touched only on the loop's thread
        self._adds_in_flight: set[asyncio.Future] = set()  # sent to the engine thread, unanswered (loop thread)
        self._calls_in_flight: set[asyncio.Future] = set()  # likewise, for `call`
        self._stats: dict[str, Any] = engine.stats()  # replaced (never mutated) by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
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

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of its last step (read without touching the engine)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self._stats["num_waiting"] + len(self._adds_in_flight)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          outputs: asyncio.Queue) -> None:
        """Queue a request whose outputs go to `outputs`; raises ValueError (bad input) before anything runs."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        if self.num_waiting >= self.max_waiting:
            raise EngineOverloadedError(self.num_waiting)
        accepted = self._loop.create_future()
        self._outputs[request_id] = outputs
        self._adds_in_flight.add(accepted)
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
            sink.put_nowait(output)
            if output.finished:
                del self._outputs[output.request_id]

    def _fail_all(self, error: EngineDeadError) -> None:
        for sink in self._outputs.values():
            sink.put_nowait(error)
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
            self._stats = self.engine.stats()  # before answering, so an accepted request is counted as waiting
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
                self._observer([output], time.time())
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

    def _step(self) -> None:
        outputs = self.engine.step()
        self._observer(outputs, time.time())
        self._stats = self.engine.stats()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _abort_all(self) -> None:
        aborted = [self.engine.abort_request(request_id) for request_id in list(self.engine.requests)]
        aborted = [output for output in aborted if output is not None]
        self._observer(aborted, time.time())
        self._stats = self.engine.stats()
        if aborted:
            self._loop.call_soon_threadsafe(self._deliver, aborted)


def _settle(future: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
    if future.done():  # its handler was cancelled while waiting
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


async def updates(outputs: asyncio.Queue, request_ids: list[str]) -> AsyncIterator[list[RequestOutput]]:
    """The outputs of `request_ids` as they come, until all have finished. Each item holds the latest output of
    every request that moved; outputs are cumulative, so when a client falls behind, older ones are skipped."""
    unfinished = set(request_ids)
    while unfinished:
        items = [await outputs.get()]
        while not outputs.empty():
            items.append(outputs.get_nowait())
        latest: dict[str, RequestOutput] = {}
        for item in items:
            if isinstance(item, BaseException):
                raise item
            latest[item.request_id] = item
            if item.finished:
                unfinished.discard(item.request_id)
        yield list(latest.values())
