"""Live migration of running streams between decode workers (issue 20), through the real router and workers
over a real nats-server: streams moved mid-decode go on exactly (greedy tokens equal the single-process
engine's; a seeded sampled stream equals its unmigrated twin), seq gap-free, no token twice, usage counts the
migration, the source frees the blocks; a migration that fails mid-way leaves the stream decoding where it was."""
import asyncio

import pytest

from shared import protocol, subjects
from shared.client import generate, generate_stream
from shared.errors import DeepinferError, ErrorCode
from tests.integration.conftest import connect
from tests.integration.services_harness import (InProcessCluster, all_blocks_free, fault_first_call,
                                                reference_outputs, wait_until)
from tests.model_factory import write_tiny_hf_folder

TOKENS = 1000  # long enough that every stream still runs when its order comes (orders go one by one)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=2048)


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % 250 + 3 for j in range(20 + 3 * i)] for i in range(n)]


def request(prompt, rid: str, **kw) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=kw.pop("max_tokens", TOKENS),
                                    temperature=kw.pop("temperature", 0.0), ignore_eos=True, timeout_s=120.0,
                                    prefill_mode="remote", **kw)


async def collect(nc, req, started: asyncio.Event | None = None, after: int = 4):
    """The stream's chunks; ``started`` is set once ``after`` tokens arrived."""
    chunks, seen = [], 0
    async for chunk in generate_stream(nc, req):
        chunks.append(chunk)
        seen += len(chunk.token_ids)
        if started is not None and seen >= after:
            started.set()
    return chunks


async def streaming(nc, req, after: int = 4) -> asyncio.Task:
    """``collect`` of ``req`` in a task, returned once ``after`` tokens arrived."""
    started = asyncio.Event()
    task = asyncio.create_task(collect(nc, req, started, after))
    await asyncio.wait_for(started.wait(), 30)
    return task


async def ask_router(nc, cluster, rid: str, target: str = "") -> protocol.Ack:
    reply = await nc.request(subjects.ctl(cluster.router.config.worker_id, "migrate"),
                             protocol.encode(protocol.MigrateRequest(request_id=rid, target=target)), timeout=30)
    return protocol.decode_reply(reply.data, protocol.Ack)


async def test_half_of_the_streams_move_mid_decode_and_stay_exact(nats_server, folder):
    ps = prompts(8)
    expected = reference_outputs(folder, ps, TOKENS)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm,stream",
                                router_kw={"migrate_skew_min": 0, "migrate_kv_high": 2.0}) as cluster:  # orders only
        nc = await connect(nats_server.url)
        try:
            started = [asyncio.Event() for _ in ps]
            tasks = [asyncio.create_task(collect(nc, request(p, f"m{i}"), started[i])) for i, p in enumerate(ps)]
            for i in range(0, len(ps), 2):
                await asyncio.wait_for(started[i].wait(), 30)
            acks = [await ask_router(nc, cluster, f"m{i}") for i in range(0, len(ps), 2)]  # ≤ 2 per worker at once
            results = await asyncio.gather(*tasks)
        finally:
            await nc.close()
        assert all(a.detail.startswith("decode-") for a in acks)
        for i, chunks in enumerate(results):
            assert [c.seq for c in chunks] == list(range(len(chunks)))         # gap-free, each once
            assert [t for c in chunks for t in c.token_ids] == expected[i], f"stream {i} diverged"
            assert chunks[-1].usage.get("migrations", 0) == (1 if i % 2 == 0 else 0), chunks[-1].usage
        desks = [w.desk for w in cluster.workers if hasattr(w, "desk")]
        assert sum(d.sent for d in desks) == len(ps) // 2 and sum(d.failed for d in desks) == 0
        assert sum(d.precopied_blocks for d in desks) > 0      # full blocks went ahead while decoding went on
        assert cluster.router.migrator.done == len(ps) // 2
        assert await wait_until(lambda: all_blocks_free(cluster))          # the sources freed what moved


async def test_a_seeded_sampled_stream_equals_its_unmigrated_twin(nats_server, folder):
    prompt = prompts(1)[0]
    sampled = {"temperature": 0.8, "seed": 4321, "top_k": 50}
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="stream") as cluster:
        nc = await connect(nats_server.url)
        try:
            twin = (await generate(nc, request(prompt, "twin", **sampled)))[0]
            task = await streaming(nc, request(prompt, "moved", **sampled), 10)
            await ask_router(nc, cluster, "moved")
            chunks = await task
        finally:
            await nc.close()
    assert [t for c in chunks for t in c.token_ids] == twin and chunks[-1].usage["migrations"] == 1


async def test_a_migration_that_fails_mid_way_leaves_the_stream_where_it_was(nats_server, folder, monkeypatch):
    """Every fetch on the way fails (a transport error injected: the pre-copy and the switch): the source
    reattaches the sequence and finishes it, nothing lost; the router answers the order with the error."""
    prompt = prompts(12)[11]  # 53 tokens: enough full blocks to pre-copy
    expected = reference_outputs(folder, [prompt], TOKENS)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="stream") as cluster:
        calls = []

        async def broken(*args, **kwargs):
            calls.append(args)
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, "injected: the link broke mid-copy")
        nc = await connect(nats_server.url)
        try:
            task = await streaming(nc, request(prompt, "f"), 6)
            with monkeypatch.context() as patch:
                for w in cluster.workers:
                    patch.setattr(w.transports["stream"], "fetch", broken)
                with pytest.raises(DeepinferError) as info:
                    await ask_router(nc, cluster, "f")
            chunks = await task
        finally:
            await nc.close()
        assert len(calls) == 2 and info.value.code == ErrorCode.TRANSFER_FAILED   # pre-copy, then the switch
        assert [t for c in chunks for t in c.token_ids] == expected and "migrations" not in chunks[-1].usage
        assert sum(w.desk.failed for w in cluster.workers if hasattr(w, "desk")) == 1
        assert cluster.router.migrator.failed == 1
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_a_failed_pre_copy_falls_back_to_shipping_every_block(nats_server, folder, monkeypatch):
    prompt = prompts(12)[11]
    expected = reference_outputs(folder, [prompt], TOKENS)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="stream") as cluster:
        transports = [w.transports["stream"] for w in cluster.workers]

        async def broken(transport):
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, "injected: the pre-copy's fetch failed")
        nc = await connect(nats_server.url)
        try:
            task = await streaming(nc, request(prompt, "p"), 6)
            hit = fault_first_call(monkeypatch, transports, "fetch", broken)
            await ask_router(nc, cluster, "p")
            chunks = await task
        finally:
            await nc.close()
        assert hit and [t for c in chunks for t in c.token_ids] == expected and chunks[-1].usage["migrations"] == 1
        desks = [w.desk for w in cluster.workers if hasattr(w, "desk")]
        assert sum(d.sent for d in desks) == 1 and sum(d.precopied_blocks for d in desks) == 0


async def test_orders_that_cannot_be_served_are_refused(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1) as cluster:
        nc = await connect(nats_server.url)
        try:
            with pytest.raises(DeepinferError) as info:
                await ask_router(nc, cluster, "nobody")
            assert info.value.code == ErrorCode.INVALID_REQUEST
            task = await streaming(nc, request(prompts(1)[0], "alone"))
            with pytest.raises(DeepinferError) as info:          # one decode worker: nowhere to go
                await ask_router(nc, cluster, "alone")
            assert info.value.code == ErrorCode.UNAVAILABLE
            assert len([t for c in await task for t in c.token_ids]) == TOKENS
            worker = cluster.workers[-1]                          # a worker refuses an order for a stranger
            reply = await nc.request(subjects.ctl(worker.config.worker_id, "migrate"), protocol.encode(
                protocol.MigrateRequest(request_id="stranger", target="decode-9", transport="shm")), timeout=5)
            with pytest.raises(DeepinferError) as info:
                protocol.decode_reply(reply.data, protocol.Ack)
            assert info.value.code == ErrorCode.INVALID_REQUEST
        finally:
            await nc.close()


async def test_a_draining_decode_worker_moves_its_streams_instead_of_handing_them_back(nats_server, folder):
    """Drain with migration: no stream of the drained worker is prefilled again (no failover), all are exact."""
    ps = prompts(6)
    expected = reference_outputs(folder, ps, TOKENS)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm,stream",
                                router_kw={"migrate_kv_high": 2.0, "migrate_skew_min": 0}) as cluster:  # drain only
        nc = await connect(nats_server.url)
        try:
            started = [asyncio.Event() for _ in ps]
            tasks = [asyncio.create_task(collect(nc, request(p, f"d{i}"), started[i])) for i, p in enumerate(ps)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            live = cluster.router.relay.live
            on = {rid: s.attempt.decode_w.report.worker_id for rid, s in live.items() if s.attempt is not None}
            drained = next(w for w in cluster.workers if w.config.worker_id == on["d0"])
            await drained.shutdown()            # SIGTERM's drain: withdraw, wait for its streams to leave
            results = await asyncio.gather(*tasks)
        finally:
            await nc.close()
        moved = [rid for rid, wid in on.items() if wid == drained.config.worker_id]
        for i, chunks in enumerate(results):
            usage = chunks[-1].usage
            assert [t for c in chunks for t in c.token_ids] == expected[i], f"stream {i} diverged"
            assert usage["failovers"] == 0 and usage.get("migrations", 0) == (f"d{i}" in moved), usage
        assert drained.desk.sent == len(moved) and cluster.router.migrator.reasons == {"drain": len(moved)}


async def test_a_target_that_stops_answering_mid_copy_costs_a_pause_not_the_stream(nats_server, folder, monkeypatch):
    """The target hangs in its fetch (as if SIGKILLed mid-copy: no Ack ever comes): after the hand-off timeout
    the source reattaches the sequence and finishes it, exact and gap-free."""
    prompt = prompts(3)[2]
    expected = reference_outputs(folder, [prompt], TOKENS)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="stream",
                                handoff_timeout_s=1.0) as cluster:
        async def hang(*args, **kwargs):
            await asyncio.sleep(3600)
        nc = await connect(nats_server.url)
        try:
            task = await streaming(nc, request(prompt, "h"), 6)
            with monkeypatch.context() as patch:   # every fetch hangs: the pre-copy's, then the switch's
                for w in cluster.workers:
                    patch.setattr(w.transports["stream"], "fetch", hang)
                with pytest.raises(DeepinferError):
                    await ask_router(nc, cluster, "h")
            chunks = await task
        finally:
            await nc.close()
        assert [t for c in chunks for t in c.token_ids] == expected
        assert [c.seq for c in chunks] == list(range(len(chunks))) and "migrations" not in chunks[-1].usage
