"""``AsyncEngine.launch``: the engine is built and stepped on one thread (one OpenMP pool per worker
process), a failed build surfaces to the caller, and the launched engine serves requests."""
import asyncio
import threading

import pytest

from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from tests.tiny_model import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, max_position_embeddings=64)


async def test_build_and_steps_run_on_one_thread_that_is_not_the_loop(model):
    built_on, stepped_on = [], set()

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=16))
        step = engine.step

        def recording_step():
            stepped_on.add(threading.get_ident())
            return step()
        engine.step = recording_step
        return engine

    aengine = await AsyncEngine.launch(build)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        outs = [out async for out in aengine.run("r0", lambda: aengine.engine.add_request([1, 2, 3], params, "r0"),
                                                 params.max_tokens + 1)]
        assert stepped_on == set(built_on) == {await aengine.call(threading.get_ident)}
        assert built_on[0] != threading.get_ident()
        tokens = [t for out in outs for t in out.new_token_ids]
        reference = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=16)).generate([[1, 2, 3]], params)
        assert tokens == reference[0] and outs[-1].finished
    finally:
        await aengine.stop()


async def test_a_failed_build_raises_to_the_caller_and_its_thread_ends():
    threads = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await AsyncEngine.launch(build)
    threads[0].join(5.0)
    assert not threads[0].is_alive()


async def test_a_caller_giving_up_mid_build_leaves_the_thread_to_end_cleanly(model):
    """Cancelled while the model loads: the build finishes, the thread sees the stop and ends (an exception on
    that thread would fail this test: pytest turns unhandled thread exceptions into errors here)."""
    started, release, threads = threading.Event(), threading.Event(), []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        started.set()
        release.wait(10)
        return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=16))

    task = asyncio.ensure_future(AsyncEngine.launch(build))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    threads[0].join(5.0)
    assert not threads[0].is_alive()


async def test_calls_before_launch_are_refused():
    aengine = AsyncEngine(None)
    with pytest.raises(DeepinferError) as err:
        await aengine.call(lambda: None)
    assert err.value.code == ErrorCode.UNAVAILABLE
