"""What the router-death chaos tests share: a cluster of two routers in one queue group before one aggregated
decode worker, on a tiny float64 model slow enough that a long request outlives a kill, and the routers' stats."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats

from shared import protocol, subjects
from cli.launcher import Cluster
from tests.chaos.harness import chaos_cluster
from tests.model_factory import write_tiny_hf_folder


def slow_tiny_model(path: Path) -> Path:
    return write_tiny_hf_folder(path, seed=4, max_position_embeddings=1024, num_layers=6, hidden=192, ffn=384)


async def router_stats(nc, router: str) -> dict:
    """``router``'s stats (``deepinfer status``'s source) over NATS."""
    reply = await nc.request(subjects.stats(router), protocol.encode(protocol.StatsRequest()), timeout=5)
    return protocol.decode(reply.data, protocol.StatsReply).stats


async def two_router_cluster(server, folder: Path | str, http_port_b: int = -1) -> Cluster:
    """Started: ``router`` and ``router-b`` (its HTTP port ``http_port_b``, -1 none) before ``decode-0``, once
    router-b sees the worker alive. The caller stops it (also when this raises: it is returned only started)."""
    cluster = chaos_cluster(server, folder, prefill=0, decode=1, drain_grace_s="2")
    try:
        await cluster.start()
        await cluster.wait_healthy([cluster.spawn_router("router-b", http_port_b)], timeout=90)
        nc = await nats.connect(server.url, connect_timeout=5)
        try:
            deadline = time.monotonic() + 30
            while not (await router_stats(nc, "router-b"))["workers"].get("decode-0", {}).get("alive"):
                assert time.monotonic() < deadline, "router-b never saw decode-0"
                await asyncio.sleep(0.2)
        finally:
            await nc.close()
    except BaseException:
        cluster.stop()
        raise
    return cluster
