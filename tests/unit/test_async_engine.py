"""``AsyncEngine.launch``: the engine is built and stepped on one thread (one OpenMP pool per worker
process), a failed build surfaces to the caller, and the launched engine serves requests."""
import threading

import pytest

from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from tests.tiny_model import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, max_position_embeddings=64)


async def test_build_and_steps_run_on_one_thread_that_is_not_the_loop(model):
    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        return LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=16))

    aengine = await AsyncEngine.launch(build)
    try:
        stepped_on = []
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

        def submit():
            stepped_on.append(threading.get_ident())
            aengine.engine.add_request([1, 2, 3], params, "r0")

        outs = [out async for out in aengine.run("r0", submit, params.max_tokens + 1)]
        assert built_on == stepped_on == [await aengine.call(threading.get_ident)]
        assert built_on[0] != threading.get_ident()
        tokens = [t for out in outs for t in out.new_token_ids]
        reference = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=16)).generate([[1, 2, 3]], params)
        assert tokens == reference[0] and outs[-1].finished
    finally:
        await aengine.stop()


async def test_a_failed_build_raises_to_the_caller_and_leaves_no_engine_running():
    def build() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await AsyncEngine.launch(build)
    for thread in threading.enumerate():  # the engine thread ends once its build has failed
        if thread.name == "engine":
            thread.join(5.0)
            assert not thread.is_alive()


async def test_calls_before_launch_are_refused():
    aengine = AsyncEngine(None)
    with pytest.raises(DeepinferError) as err:
        await aengine.call(lambda: None)
    assert err.value.code == ErrorCode.UNAVAILABLE
