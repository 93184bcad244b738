"""Chaos: the target of a live migration dies mid-way (frozen by SIGSTOP as the order starts, so the source's
pre-copy and hand-over wait on it, then SIGKILLed), in a cluster of real processes.

Asserts: the stream finishes on its source, exactly (the single-process engine's greedy tokens, seq gap-free, no
duplicate), with no migration and no failover counted (nothing was re-prefilled); the router answers the order
with an error; the cluster serves a new request afterwards.
"""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shared import protocol, subjects
from cli.launcher import Cluster, ClusterSpec
from tests.chaos.harness import LoadWatcher, make_prompt, reference, stream_request
from tests.integration.conftest import connect, start_nats_server
from tests.model_factory import write_tiny_hf_folder

TOKENS = 3500  # a few seconds of decoding: longer than the two waits on the dead target


@pytest.mark.timeout(180)
async def test_a_migration_whose_target_dies_mid_way_leaves_the_stream_on_its_source(tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=9, max_position_embeddings=4096)
    server = start_nats_server()
    env = {"DEEPINFER_HANDOFF_TIMEOUT_S": "1.5", "DEEPINFER_HEARTBEAT_S": "0.2",
           "DEEPINFER_MIGRATE_SKEW_MIN": "0",  # moves by order only
           "DEEPINFER_MIGRATE_KV_HIGH": "2.0"}
    cluster = Cluster(ClusterSpec(prefill=1, decode=2, nats_url=server.url, model=str(folder), kv_cache_mb=32,
                                  local_prefill_threshold=0, dtype="float64", cache_tier=0, metrics=False,
                                  http_port=-1, extra_env=env))
    watcher = LoadWatcher()
    nc = None
    prompt = make_prompt(1, 120, seed=3)  # 15 full blocks to pre-copy
    request = protocol.GenerateRequest(request_id="moved", prompt_token_ids=prompt, max_tokens=TOKENS,
                                       temperature=0.0, ignore_eos=True, timeout_s=120.0, prefill_mode="remote")
    try:
        await cluster.start()
        await watcher.start(server.url)
        nc = await connect(server.url)
        stream = asyncio.create_task(stream_request(nc, request, idle_timeout_s=30.0))
        for _ in range(600):  # the stream runs on one of the decode workers
            running = {d: r.num_running for d, r in watcher.latest.items() if d.startswith("decode-")}
            if any(running.values()) or stream.done():
                break
            await asyncio.sleep(0.05)
        assert any(running.values()), (running, stream.done() and stream.result())
        source = max(running, key=running.get)
        target = "decode-1" if source == "decode-0" else "decode-0"
        os.kill(cluster.procs[target].pid, signal.SIGSTOP)  # alive to the router for a few seconds more
        order = asyncio.create_task(nc.request(
            subjects.ctl(cluster.router_name, "migrate"),
            protocol.encode(protocol.MigrateRequest(request_id="moved", target=target)), timeout=60))
        await asyncio.sleep(0.5)  # the source is waiting on the frozen target
        cluster.kill(target)
        reply = await order
        with pytest.raises(Exception):
            protocol.decode_reply(reply.data, protocol.Ack)     # the order failed, and says so
        out = await stream
        after = await stream_request(nc, protocol.GenerateRequest(
            request_id="after", prompt_token_ids=make_prompt(2, 30, seed=3), max_tokens=20, temperature=0.0,
            ignore_eos=True, timeout_s=60.0, prefill_mode="remote"), idle_timeout_s=30.0)
    finally:
        if nc is not None:
            await nc.close()
        await watcher.close()
        cluster.stop()
        server.stop()
    want, want_after = reference(folder, [prompt, after.request.prompt_token_ids], [TOKENS, 20])
    assert out.completed and out.tokens == want and not out.duplicates, (out.error, out.client_timeout)
    assert out.seqs == list(range(len(out.seqs)))
    assert out.usage.get("migrations", 0) == 0 and out.usage.get("failovers", 0) == 0, out.usage
    assert after.completed and after.tokens == want_after
    source_log = cluster.log_tail(source, 1 << 20)
    assert "failed, decoding on here" in source_log, source_log[-3000:]
