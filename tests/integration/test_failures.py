"""Fault injection with real processes: SIGKILL a decode worker mid-stream (failover), restart nats-server."""
import asyncio
import time

import pytest

from shared.client import generate
from cli.launcher import Cluster, ClusterSpec
from nats.js.errors import KeyNotFoundError

from shared import protocol, subjects
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from tests.integration.conftest import connect
from tests.model_factory import write_tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=9, max_position_embeddings=4096)


def long_request(i: int, timeout_s: float = 90.0) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(request_id=f"long-{i}", prompt_token_ids=[5 + i, 6, 7, 8] * 10,
                                    max_tokens=3000, temperature=0.0, ignore_eos=True, timeout_s=timeout_s)


def reference(folder, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of the single-process engine, no prefix cache (room for 3,000+ tokens each)."""
    engine = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=4000,
                                                           enable_prefix_caching=False))
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def test_sigkill_decode_worker_mid_stream_fails_over(nats_server, folder):
    """Streams on a decode worker killed mid-stream continue on a live one (DESIGN step 5): every client gets
    its 3,000 tokens in one gap-free stream, token for token what the single-process engine produces."""
    cluster = Cluster(ClusterSpec(prefill=1, decode=2, nats_url=nats_server.url, model=str(folder),
                                  kv_cache_mb=64, local_prefill_threshold=0,
                                  dtype="float64"))
    await cluster.start()
    try:
        nc = await connect(nats_server.url)
        reqs = [long_request(i) for i in range(6)]
        t0 = time.monotonic()
        tasks = [asyncio.create_task(generate(nc, r)) for r in reqs]  # generate checks seq 0, 1, 2, ...
        await asyncio.sleep(3.0)  # streams are flowing on both decode workers
        cluster.kill("decode-0")
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=100)
        assert time.monotonic() - t0 < 90, "no client may wait past its timeout"
        expected = reference(folder, [r.prompt_token_ids for r in reqs], 3000)
        for (ids, _, usage), want in zip(results, expected):
            assert ids == want  # no gap, no duplicate, no drift at the seam
            assert usage["completion_tokens"] == 3000 and usage["prompt_tokens"] == 40
        failovers = [usage["failovers"] for _, _, usage in results]
        assert any(failovers), f"some streams were on the killed worker: {failovers}"
        await asyncio.sleep(2.0)  # the router notices the dead worker
        registry = await nc.jetstream().key_value(subjects.REGISTRY_BUCKET)
        for _ in range(40):  # the dead worker's registration expires with the bucket's TTL
            try:
                await registry.get("decode-0")
            except KeyNotFoundError:
                break
            await asyncio.sleep(0.25)
        else:
            pytest.fail("decode-0 is still registered 10 s after it died")
        assert (await registry.get("decode-1")).value  # the live one is still there
        ids, _, usage = await generate(nc, protocol.GenerateRequest(prompt_token_ids=[9, 9, 9, 9] * 5, max_tokens=5,
                                                                    temperature=0.0, ignore_eos=True))
        assert len(ids) == 5  # the surviving workers keep serving
        await nc.close()
    finally:
        cluster.stop()
    assert all(p.poll() is not None for p in cluster.procs.values()), "no orphan processes"


async def test_services_reconnect_after_nats_restart(folder):
    from tests.integration.conftest import start_nats_server

    server = start_nats_server()
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, nats_url=server.url, model=str(folder), kv_cache_mb=32,
                                  local_prefill_threshold=0, dtype="float64"))
    try:
        await cluster.start()
        req = protocol.GenerateRequest(prompt_token_ids=list(range(3, 40)), max_tokens=8, temperature=0.0,
                                       ignore_eos=True, prefill_mode="remote")
        nc = await connect(server.url)
        before = (await generate(nc, req))[0]
        await nc.close()
        server.stop()
        await asyncio.sleep(1.0)
        server.restart()
        await cluster.wait_healthy(["router", "prefill-0", "decode-0"], timeout=30)
        nc = await connect(server.url)
        after = None
        for _ in range(20):  # the router needs a fresh heartbeat from each worker before it places work
            try:
                after = (await generate(nc, req))[0]
                break
            except DeepinferError as err:
                assert err.code == ErrorCode.UNAVAILABLE, err
                await asyncio.sleep(0.5)
        await nc.close()
        assert after == before
    finally:
        cluster.stop()
        server.stop()
