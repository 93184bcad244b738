"""Prints the registry bucket's replica count and live keys as JSON (``python -m tests.cluster.registry_probe URL``),
run inside a simulated host as the ``router`` user (``DEEPINFER_NATS_USER``/``_PASSWORD``): the router may read
the bucket's stream info, which is all this needs (``messages``: the bucket keeps one message per key, history 1)."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from shared import subjects
from shared.bus import connect


async def probe(url: str, wait_s: float = 30.0) -> dict:
    """Retries for ``wait_s`` while the bucket has no leader (a node just died: the others elect one)."""
    nc = await connect(url, "registry-probe", user=os.environ.get("DEEPINFER_NATS_USER", ""),
                       password=os.environ.get("DEEPINFER_NATS_PASSWORD", ""))
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                info = await nc.jetstream(timeout=5).stream_info(f"KV_{subjects.REGISTRY_BUCKET}")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        return {"replicas": info.config.num_replicas, "keys": info.state.messages,
                "cluster_leader": info.cluster.leader if info.cluster else None,
                "cluster_replicas": len(info.cluster.replicas or []) if info.cluster else 0}
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.stdout.write(json.dumps(asyncio.run(probe(sys.argv[1]))) + "\n")
