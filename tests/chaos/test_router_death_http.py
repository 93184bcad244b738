"""A router SIGKILLed while it answers non-streaming HTTP calls (issue 21): a client that knows two routers'
URLs (``shared/http_client.complete``) gets every answer from the other one, equal to the same call made to a
healthy router, without seeing the death; with only the dead router's URL it gets ``worker_lost`` after its
bounded attempts, not a hang.

Cluster: a test-owned nats-server, the router and router-b (each with an HTTP port), one aggregated decode worker
(real processes, a tiny float64 model; 800-token calls outlive the kill).
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from shared.errors import DeepinferError, ErrorCode
from shared.http_client import complete
from shared.nats_server import free_port
from tests.chaos.router_death import router_stats, slow_tiny_model, two_router_cluster
from tests.integration.conftest import connect, start_nats_server

CALLS = 4
MAX_TOKENS = 800   # several seconds per call: the kill lands mid-generation


def body(prompt: list[int]) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "prefill_mode": "local"}


@pytest.mark.timeout(240)
async def test_non_streaming_calls_of_a_killed_router_are_answered_by_another(tmp_path):
    folder = slow_tiny_model(tmp_path / "tiny")
    prompts = [[10 + i, 20, 30 + i, 40, 50, 60 + i, 70, 80] for i in range(CALLS)]
    server = start_nats_server()
    port_b = free_port()
    try:
        cluster = await two_router_cluster(server, folder, port_b)
        url_a, url_b = cluster.http_url, f"http://127.0.0.1:{port_b}"
        nc = await connect(server.url)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                async with session.get(url_b + "/v1/models") as resp:
                    model_id = (await resp.json())["data"][0]["id"]
                calls = [asyncio.create_task(complete(session, [url_a, url_b], "/v1/completions",
                                                      {**body(p), "model": model_id}, backoff_s=0.2))
                         for p in prompts]
                deadline = time.monotonic() + 60
                while (await router_stats(nc, cluster.router_name))["in_flight"] < CALLS:
                    assert time.monotonic() < deadline, "the calls never reached the first router"
                    await asyncio.sleep(0.05)
                assert not any(c.done() for c in calls)         # all four mid-generation
                cluster.kill(cluster.router_name)               # SIGKILL
                answers = await asyncio.wait_for(asyncio.gather(*calls), 150)
                twins = await asyncio.gather(*(complete(session, [url_b], "/v1/completions",
                                                        {**body(p), "model": model_id}) for p in prompts))
                with pytest.raises(DeepinferError) as lost:
                    await complete(session, [url_a], "/v1/completions", {**body(prompts[0]), "model": model_id},
                                   attempts=2, backoff_s=0.1)
        finally:
            await nc.close()
            cluster.stop()
    finally:
        server.stop()
    for got, twin in zip(answers, twins):
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
        assert got["choices"][0]["text"] == twin["choices"][0]["text"]
    assert lost.value.code is ErrorCode.WORKER_LOST
    print(f"\nrouter SIGKILL during {CALLS} non-streaming HTTP calls: answered {len(answers)}, lost 0, "
          "each equal to the call made to a healthy router")
