"""The engine thread's bookkeeping, driven directly: a request is counted once while it moves from the HTTP
handler to the engine's queue (it was once counted twice, refusing requests below --max-waiting), and a request
that failed inside the engine ends its stream with RequestFailedError after its last output."""
import asyncio
import time

import pytest

from kvserve import EngineConfig, LLMEngine, SamplingParams
from kvserve.server.async_engine import AsyncEngine, EngineOverloadedError, OutputSink, RequestFailedError, updates
from tests.conftest import make_tiny_model

LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("async-engine"))


def run(model_dir, scenario, max_waiting: int = 4) -> None:
    """scenario(async_engine) on a fresh loop; one sequence runs at a time, so a second one waits."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="4MiB", max_num_seqs=1))

    async def main():
        async_engine = AsyncEngine(engine, max_waiting)
        async_engine.start()
        try:
            await scenario(async_engine)
        finally:
            async_engine.shutdown()

    asyncio.run(main())


async def add(async_engine: AsyncEngine, request_id: str, params: SamplingParams, sink: OutputSink) -> None:
    async_engine.reserve(1)
    await async_engine.add_request(request_id, [5, 6, 7, 8], params, sink)


def test_an_accepted_request_counts_once_while_it_reaches_the_engine_queue(model_dir):
    async def scenario(async_engine):
        running = OutputSink()
        await add(async_engine, "running", LONG, running)
        await running.take()  # its first token is out: it holds the only slot
        queued = asyncio.ensure_future(add(async_engine, "queued", SamplingParams(max_tokens=2), OutputSink()))
        await asyncio.sleep(0)  # the add is sent to the engine thread
        counts = [async_engine.num_waiting]
        deadline = time.monotonic() + 10
        # The loop is blocked here, so the engine thread's "accepted" cannot be handled: the moment the request
        # is in the engine's stats and still unanswered, when it used to count twice.
        while async_engine.stats()["num_waiting"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        counts.append(async_engine.num_waiting)
        await queued
        counts.append(async_engine.num_waiting)
        assert counts == [1, 1, 1]
        with pytest.raises(EngineOverloadedError):  # and the queue's bound still holds
            async_engine.reserve(4)

    run(model_dir, scenario)


def test_a_request_that_failed_inside_the_engine_ends_with_its_error(model_dir):
    async def scenario(async_engine):
        sink = OutputSink()
        bad = SamplingParams(temperature=1.0, max_tokens=4)
        bad.top_k = 2**70  # past validation: the sampler cannot build its tensor
        await add(async_engine, "bad", bad, sink)
        seen = []
        with pytest.raises(RequestFailedError, match="Overflow"):
            async for batch in updates(sink, ["bad"]):
                seen += batch
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "error"
        assert async_engine.error is None  # the engine is serving

    run(model_dir, scenario)
