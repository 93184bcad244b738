"""Chaos regression: stream chunks NATS drops across a nats-server restart must never reach a client as a
complete stream (the fixed lost-chunks bug described in tests/chaos/test_kill_restart.py)."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import time

import nats
import pytest

from shared import protocol
from tests.chaos.harness import chaos_cluster, make_prompt, reference, stream_request
from tests.chaos.test_kill_restart import quiet
from tests.integration.conftest import start_nats_server
from tests.model_factory import write_tiny_hf_folder


# Every phase scales with CPU load (2 cores: 38 s alone; 171 s next to 4 busy processes on a loaded machine, the
# streams taking 82 s and the reference 46 s): cluster start (~6 s alone), the streams (4 x 3000 tokens, ~15 s
# alone; the router ends them at their 90 s timeout_s, the client at 100 s), stop (~2 s), and the greedy reference
# (the same ~12k decode steps in one process, ~10 s alone; only for streams that completed, so at most about as
# long as they took). Where the streams just fit in their 90 s, that is ~40 + 90 + 10 + 60 s: 240 s covers every
# load at which the test still checks a stream.
@pytest.mark.timeout(240)
async def test_chunks_lost_in_a_nats_restart_are_not_relayed_as_a_complete_stream(tmp_path):
    """Deterministic repro of the lost-chunks bug with real processes. Four long greedy streams are in flight;
    the router stalls (SIGSTOP) across a nats-server restart, so the chunks the decode worker publishes once it
    has reconnected reach no router subscription and NATS drops them; the router resumes (SIGCONT) well within
    its 3 s heartbeat timeout, so it still sees the worker alive, and relays the rest of each stream.

    A final chunk without an error must mean the whole stream: ``completion_tokens == max_tokens`` and, where
    the client saw no seq gap, exactly the uninterrupted greedy tokens (the router could notice the gap in the
    worker's seq and re-place from what it delivered, or end the stream with an error). Today the router ends
    each stream "complete" (finish_reason length) with ``completion_tokens < max_tokens``, chunks missing from
    the middle. (The router may also lose a chunk it forwards while it reconnects: the client sees that as a
    seq gap, a clear error, which is allowed.)"""
    long_tokens = 3000
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=9, max_position_embeddings=4096)
    server = start_nats_server()
    cluster = chaos_cluster(server, folder, prefill=1, decode=1, drain_grace_s="2")
    worker_chunks: collections.Counter[str] = collections.Counter()  # attempt id -> chunks seen on the wire
    client_back = asyncio.Event()  # this test's connection is on the restarted server
    after_restart = asyncio.Event()  # ... and saw a worker chunk there: the router (stopped) missed it
    router_pid = None
    nc = None
    t0 = time.monotonic()

    def phase(name: str) -> None:  # printed as it goes: a timeout's report shows where the time went
        print(f"{time.monotonic() - t0:6.1f} s: {name}", flush=True)

    try:
        await cluster.start()
        phase("cluster up")
        router_pid = cluster.procs["router"].pid
        async def on_reconnect() -> None:
            client_back.set()

        nc = await nats.connect(server.url, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                reconnected_cb=on_reconnect, error_cb=quiet)

        async def spy(msg) -> None:  # worker -> router chunks: their request ids are attempt ids ("<id>~<n>")
            with contextlib.suppress(Exception):
                chunk = protocol.decode(msg.data, protocol.TokenChunk)
                if "~" in chunk.request_id:
                    worker_chunks[chunk.request_id] += 1
                    if client_back.is_set():
                        after_restart.set()

        await nc.subscribe("_INBOX.>", cb=spy)
        reqs = [protocol.GenerateRequest(request_id=f"long-{i}", prompt_token_ids=make_prompt(i, 24, seed=3),
                                         max_tokens=long_tokens, temperature=0.0, ignore_eos=True, timeout_s=90.0,
                                         prefill_mode="local" if i % 2 else "remote") for i in range(4)]
        tasks = [asyncio.create_task(stream_request(nc, r, idle_timeout_s=30.0)) for r in reqs]
        deadline = time.monotonic() + 30
        while sum(n >= 20 for n in worker_chunks.values()) < len(reqs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # every stream is decoding
        phase("streams decoding")
        os.kill(router_pid, signal.SIGSTOP)
        try:
            server.stop()
            server.restart()
            await asyncio.wait_for(after_restart.wait(), 10)  # the worker reconnected and publishes: dropped
        finally:
            os.kill(router_pid, signal.SIGCONT)
        phase("nats-server restarted, router resumed")
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        phase("streams ended")
    finally:
        if router_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(router_pid, signal.SIGCONT)
        if nc is not None:
            await nc.close()
        cluster.stop()
        server.stop()
    phase("cluster stopped")
    for out in outs:
        print(out.describe(t0))
    # a final chunk without error claims the whole stream: max_tokens tokens (ignore_eos, no stop), and exactly
    # the greedy ones where the client saw no gap (a gap between router and client is a client-visible error).
    # The greedy reference is computed for the streams that need the comparison only (most of the test's CPU).
    claims = [o for o in outs if o.final and o.error is None and o.usage is not None]
    compare = [o for o in claims if o.usage.get("completion_tokens") == o.request.max_tokens and not o.gaps]
    expected = dict(zip((o.request.request_id for o in compare), reference(
        folder, [o.request.prompt_token_ids for o in compare], [o.request.max_tokens for o in compare])
        if compare else []))
    phase(f"reference for {len(compare)} streams")
    false_claims = [o for o in claims if o.usage.get("completion_tokens") != o.request.max_tokens
                    or (not o.gaps and o.tokens != expected[o.request.request_id])]
    assert not false_claims, "streams ended as complete with worker chunks missing:\n" + "\n".join(
        f"{o.request.request_id}: final chunk finish_reason={o.finish_reason}, completion_tokens "
        f"{o.usage.get('completion_tokens')} of max_tokens {o.request.max_tokens}; client got {len(o.tokens)} "
        f"tokens, seq gaps {o.gaps}" for o in false_claims)
