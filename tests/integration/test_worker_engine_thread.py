"""Each worker builds its model on the thread that steps its engine (one OpenMP pool per process; see
``shared/engine/async_engine.py``), and a worker whose model cannot be loaded fails its start."""
import threading

import pytest

from services.decode.service import DecodeService
from shared.engine.llm_engine import LLMEngine
from shared.errors import DeepinferError, ErrorCode
from tests.integration.services_harness import InProcessCluster, generate_once, reference_outputs, worker_config
from tests.model_factory import write_tiny_hf_folder
from tests.integration.test_disaggregated import request


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=256)


async def test_model_is_loaded_on_the_engine_thread_of_every_worker(nats_server, folder, monkeypatch):
    loaded_on: list[int] = []
    load = LLMEngine.from_path.__func__

    def recording_load(cls, *args, **kwargs):
        loaded_on.append(threading.get_ident())
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "from_path", classmethod(recording_load))
    prompt = [5, 9, 17, 33, 2, 8, 41, 7, 3, 12]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1) as cluster:
        engine_threads = [await w.aengine.call(threading.get_ident) for w in cluster.workers]
        assert sorted(loaded_on) == sorted(engine_threads) and len(set(engine_threads)) == 2
        assert threading.get_ident() not in engine_threads
        ids, _text, _usage = await generate_once(nats_server.url, request(prompt, prefill_mode="remote",
                                                                          transport="shm"))
    monkeypatch.undo()
    assert ids == reference_outputs(folder, [prompt], len(ids))[0]


async def test_a_worker_whose_model_cannot_load_fails_to_start(nats_server, tmp_path, monkeypatch):
    threads = []
    load = LLMEngine.from_path.__func__

    def recording_load(cls, *args, **kwargs):
        threads.append(threading.current_thread())
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "from_path", classmethod(recording_load))
    worker = DecodeService(worker_config("decode", nats_server.url, tmp_path / "missing", "decode-bad"))
    with pytest.raises(DeepinferError) as err:
        await worker.start()
    assert err.value.code == ErrorCode.MODEL_NOT_FOUND and worker.nc.is_closed
    assert len(threads) == 1 and threads[0] is not threading.current_thread()
    threads[0].join(5.0)
    assert not threads[0].is_alive()  # the engine thread ended with its failed build
