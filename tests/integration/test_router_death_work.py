"""Workers stop work whose router died, and decode workers honour the request's deadline (issue 21).

The test plays the router: it dispatches work naming ``router_id`` / ``router_instance`` straight to the workers
(real NATS, in-process services) and publishes — or stops publishing — that router's heartbeats. The model is
slow enough (8 layers) that a 2,000-token stream outlives every check by seconds.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from shared import protocol, subjects
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, all_blocks_free, wait_until
from tests.model_factory import write_tiny_hf_folder

DEAD_AFTER_S = 1.0  # the workers' router_dead_after_s here
LONG = 2000         # tokens: ~10 s on this model, far longer than any wait below


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("slow"), seed=3, max_position_embeddings=4096,
                                num_layers=8, hidden=256, ffn=512)


def router_beat(instance: str) -> bytes:
    return protocol.encode(protocol.LoadReport(
        worker_id="router-z", role="router", model_id="", num_running=1, num_waiting=0, kv_usage=0.0,
        num_free_blocks=0, num_total_blocks=0, block_size=0, transports=[], host="h", timestamp=time.time(),
        instance=instance))


class FakeRouter:
    """Heartbeats of ``router-z`` every 0.2 s as ``instance`` (changeable) until stopped."""

    def __init__(self, nc) -> None:
        self.nc, self.instance, self.beating = nc, "first", True
        self.task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while self.beating:
            await self.nc.publish(subjects.load("router-z", "router"), router_beat(self.instance))
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self.beating = False
        await self.task


async def dispatch(nc, role: str, max_tokens: int, reply_to: str, **kw) -> None:
    sampling = protocol.Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 40))
    if role == "prefill":
        work = protocol.PrefillRequest(request_id="w~0", prompt_token_ids=prompt, sampling=sampling,
                                       decode_worker="decode-0", transport="shm", reply_to=reply_to,
                                       deadline_s=kw.pop("deadline_s", 600.0), **kw)
    else:
        work = protocol.DecodeLocalRequest(request_id="w~0", prompt_token_ids=prompt, sampling=sampling,
                                           reply_to=reply_to, **{"deadline_s": 600.0, **kw})
    reply = await nc.request(subjects.prefill("prefill-0") if role == "prefill" else subjects.decode("decode-0"),
                             protocol.encode(work), timeout=10)
    assert isinstance(protocol.decode(reply.data, (protocol.Ack, protocol.ErrorReply)), protocol.Ack)


async def collect(nc, inbox: str) -> tuple[list[protocol.TokenChunk], asyncio.Event]:
    """Chunks published to ``inbox`` (appended as they come) and an event set on the final one."""
    chunks: list[protocol.TokenChunk] = []
    final = asyncio.Event()

    async def on_msg(msg) -> None:
        chunk = protocol.decode(msg.data, protocol.TokenChunk)
        chunks.append(chunk)
        if chunk.final:
            final.set()
    await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=LONG + 16)
    return chunks, final


def held(cluster) -> bool:
    return any(w.active for w in cluster.workers)


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_work_of_a_silent_router_is_stopped(nats_server, folder, role):
    """The router dies mid-stream (its heartbeats stop): the decode worker stops generating within
    router_dead_after_s (+ a sweep) instead of streaming 2,000 tokens into a dead inbox, and frees the blocks."""
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, kv_cache_mb=48,
                                router_dead_after_s=DEAD_AFTER_S) as cluster:
        nc = await connect(nats_server.url)
        try:
            router = FakeRouter(nc)
            inbox = nc.new_inbox()
            chunks, _ = await collect(nc, inbox)
            await dispatch(nc, role, LONG, inbox, router_id="router-z", router_instance="first")
            assert await wait_until(lambda: len(chunks) >= 20)
            await router.stop()
            t_dead = time.monotonic()
            assert await wait_until(lambda: not held(cluster), timeout=DEAD_AFTER_S + 3.0), "still generating"
            stopped_after = time.monotonic() - t_dead
            assert await wait_until(lambda: all_blocks_free(cluster))
        finally:
            await nc.close()
    assert len(chunks) < LONG // 2 and not any(c.final for c in chunks)
    assert stopped_after < DEAD_AFTER_S + 3.0


async def test_a_router_restarted_under_the_same_id_is_another_relay(nats_server, folder):
    """Heartbeats resume under the same router id but another instance: the old stream is stopped at once."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, kv_cache_mb=48,
                                router_dead_after_s=30.0) as cluster:
        nc = await connect(nats_server.url)
        try:
            router = FakeRouter(nc)
            inbox = nc.new_inbox()
            chunks, _ = await collect(nc, inbox)
            await dispatch(nc, "decode", LONG, inbox, router_id="router-z", router_instance="first")
            assert await wait_until(lambda: len(chunks) >= 20)
            router.instance = "second"
            assert await wait_until(lambda: not held(cluster), timeout=3.0), "the old instance's work goes on"
            await router.stop()
        finally:
            await nc.close()
    assert len(chunks) < LONG // 2


async def test_work_of_a_live_router_runs_to_the_end(nats_server, folder):
    """While the router heartbeats, a stream longer than router_dead_after_s is not touched."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, kv_cache_mb=48,
                                router_dead_after_s=DEAD_AFTER_S):
        nc = await connect(nats_server.url)
        try:
            router = FakeRouter(nc)
            inbox = nc.new_inbox()
            chunks, final = await collect(nc, inbox)
            t0 = time.monotonic()
            await dispatch(nc, "decode", LONG // 2, inbox, router_id="router-z", router_instance="first")
            await asyncio.wait_for(final.wait(), 60)
            took = time.monotonic() - t0
            await router.stop()
        finally:
            await nc.close()
    assert chunks[-1].final and chunks[-1].error is None and len(chunks) == LONG // 2
    assert took > DEAD_AFTER_S + 0.5, f"the stream ({took:.1f} s) must outlast the router timeout to show anything"


async def test_decode_worker_ends_a_request_at_its_deadline(nats_server, folder):
    """A decode request whose deadline passes ends with one final ``timeout`` chunk, after the tokens it
    streamed (decode workers used to ignore deadline_s)."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, kv_cache_mb=48) as cluster:
        nc = await connect(nats_server.url)
        try:
            inbox = nc.new_inbox()
            chunks, final = await collect(nc, inbox)
            await dispatch(nc, "decode", LONG, inbox, deadline_s=1.0)
            await asyncio.wait_for(final.wait(), 5)
            assert await wait_until(lambda: all_blocks_free(cluster))
        finally:
            await nc.close()
    assert chunks[-1].error is not None and chunks[-1].error["code"] == "timeout", chunks[-1]
    assert 0 < len(chunks) - 1 < LONG // 2 and [c.seq for c in chunks] == list(range(len(chunks)))
