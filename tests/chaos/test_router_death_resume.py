"""A router SIGKILLed mid-stream (issue 21): with two routers in the queue group, every stream it relayed
continues through the other one from the tokens the client already has (``shared/client.py``'s resume):
all complete, exact, seq gap-free, no token twice; the dead router's work stops on the worker.

Cluster: a test-owned nats-server + router + router-b + one aggregated decode worker (real processes, a tiny
float64 model slow enough that a 160-token stream outlives the kill by seconds).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from shared import protocol
from shared.client import generate_stream
from tests.chaos.harness import reference
from tests.chaos.router_death import router_stats, slow_tiny_model, two_router_cluster
from tests.integration.conftest import connect, start_nats_server

STREAMS = 8
MAX_TOKENS = 160


async def in_flight(nc, router: str) -> int:
    return (await router_stats(nc, router))["in_flight"]


@pytest.mark.timeout(180)
async def test_streams_of_a_killed_router_continue_through_another(tmp_path):
    folder = slow_tiny_model(tmp_path / "tiny")
    prompts = [[10 + i, 20, 30 + i, 40, 50, 60 + i, 70, 80] for i in range(STREAMS)]
    server = start_nats_server()
    results: dict[int, dict] = {}
    try:
        cluster = await two_router_cluster(server, folder)
        nc = await connect(server.url)
        try:
            async def stream(i: int) -> None:
                req = protocol.GenerateRequest(request_id=f"s{i}", prompt_token_ids=prompts[i], max_tokens=MAX_TOKENS,
                                               temperature=0.0, ignore_eos=True, prefill_mode="local")
                out = results[i] = {"tokens": [], "seqs": [], "usage": None}
                async for chunk in generate_stream(nc, req, idle_timeout=60):
                    out["tokens"] += chunk.token_ids
                    out["seqs"].append(chunk.seq)
                    out["usage"] = chunk.usage or out["usage"]

            tasks = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
            deadline = time.monotonic() + 60
            while not all(len(results.get(i, {}).get("tokens", ())) >= 5 for i in range(STREAMS)):
                assert time.monotonic() < deadline, "streams did not start"
                await asyncio.sleep(0.05)
            held = {name: await in_flight(nc, name) for name in (cluster.router_name, "router-b")}
            victim = max(held, key=held.get)
            cluster.kill(victim)  # SIGKILL, mid-stream
            t_kill = time.monotonic()
            done_at_kill = sum(1 for r in results.values() if r["usage"] is not None)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            took = time.monotonic() - t_kill
        finally:
            await nc.close()
            cluster.stop()
    finally:
        server.stop()
    expected = reference(folder, prompts, [MAX_TOKENS] * STREAMS)
    resumed = [i for i, r in results.items() if r["usage"].get("resumed")]
    print(f"\nrouter SIGKILL mid-stream: {held} in flight per router, killed {victim}; sent {STREAMS}, completed "
          f"{sum(r['usage'] is not None for r in results.values())}, resumed {len(resumed)}, lost 0, duplicated "
          f"{sum(len(r['seqs']) != len(set(r['seqs'])) for r in results.values())}; all done {took:.1f} s after "
          f"the kill ({done_at_kill} had finished before it)")
    assert held[victim] >= STREAMS // 2 and len(resumed) == held[victim] - done_at_kill
    for i, r in results.items():
        assert r["seqs"] == list(range(len(r["seqs"]))), f"stream {i}: seq gaps or repeats {r['seqs']}"
        assert r["tokens"] == expected[i], f"stream {i} differs from the uninterrupted greedy tokens"
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
