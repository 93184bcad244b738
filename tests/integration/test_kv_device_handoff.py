"""Remote prefill on CUDA engines: the prefill worker's KV cache lives on the GPU, ``stage_blocks`` takes it
from there (one gather on the device + one device -> host copy) and the decode worker continues exactly.

``cuda_ipc`` is not exercised here: the in-process cluster runs both workers in one process, and CUDA IPC
handles open only in another process (tests/gpu/test_cuda_paths.py covers it).
"""
import asyncio
import random

import pytest

from shared.client import generate
from shared import protocol
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs
from tests.model_factory import write_tiny_hf_folder

pytestmark = pytest.mark.gpu

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=512)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 280) for _ in range(rng.choice([5, 8, 17, 40, 77]))] for _ in range(n)]


def request(prompt: list[int], **kw) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    ignore_eos=True, timeout_s=60.0, **kw)


@pytest.mark.parametrize("transport", ["shm", "stream"])
async def test_remote_prefill_from_a_cuda_cache_is_exact(nats_server, folder, transport):
    ps = prompts(6)
    expected = reference_outputs(folder, ps, MAX_TOKENS)
    async with InProcessCluster(nats_server.url, folder, transports=transport, device="cuda") as cluster:
        assert all(w.engine.runner.kv_cache.is_cuda for w in cluster.workers)
        nc = await connect(nats_server.url)
        try:
            # distinct cache salts: the local runs must not reuse the handed-off blocks (prefix cache)
            remote = await asyncio.gather(*(generate(nc, request(p, prefill_mode="remote", transport=transport,
                                                                 cache_salt="remote")) for p in ps))
            local = await asyncio.gather(*(generate(nc, request(p, prefill_mode="local", cache_salt="local"))
                                           for p in ps))
        finally:
            await nc.close()
    remote_ids, local_ids = [r[0] for r in remote], [r[0] for r in local]
    assert remote_ids == local_ids, "the hand-off changed the continuation on the same CUDA engines"
    assert remote_ids == expected
