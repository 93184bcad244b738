"""The cache-tier service on its own (real NATS): put and get through a real KV transport round-trip bytes
exactly; every kind of bad input gets an error reply (or a 0-block answer) and loses nothing already stored."""
from __future__ import annotations

import msgpack
import pytest
import torch

from services.cache_tier.service import CacheTierService
from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode
from shared.kv.transport_stream import StreamTransport
from tests.integration.conftest import connect
from tests.integration.services_harness import TIER_ID, tier_config, wait_until

SHAPE = [2, 2, 4, 1, 3]           # one block: [layers, k/v, block_size, kv heads, head dim]
BS = 4


def kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))   # [n, *SHAPE] float32


async def listen(nc, events: list):
    async def on_event(msg) -> None:
        events.append(protocol.decode(msg.data))
    return await nc.subscribe(subjects.KV_EVENTS, cb=on_event)


def tokens(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n * BS)]


@pytest.fixture
async def tier(nats_server, tmp_path):
    service = CacheTierService(tier_config(nats_server.url, tmp_path, transports="stream"))
    await service.start()
    try:
        yield service
    finally:
        await service.shutdown()


@pytest.fixture
async def sender(nc):
    transport = StreamTransport(nc, "client-0")
    try:
        yield transport
    finally:
        await transport.close()


async def put(nc, transport, tid: str, hashes: list[int], payload: torch.Tensor, writer: str = "client-0",
              **kw) -> protocol.Ack:
    """A put by ``writer`` (the subject's; the body names ``kw["worker_id"]``, by default the same)."""
    handle = await transport.stage(payload, tid)
    try:
        msg = protocol.CachePut(transfer_id=tid, worker_id=kw.pop("worker_id", writer),
                                retention=kw.pop("retention", "chat"),
                                block_hashes=hashes, token_ids=kw.pop("token_ids", tokens(len(hashes))),
                                block_size=BS, dtype="float32", block_shape=kw.pop("block_shape", SHAPE),
                                transport="stream", handle=handle, **kw)
        reply = await nc.request(subjects.cache_put(TIER_ID, writer), protocol.encode(msg), timeout=5)
        return protocol.decode_reply(reply.data, protocol.Ack)
    finally:
        await transport.release(tid)


async def get(nc, tid: str, hashes: list[int], token_ids=None, retention="chat", shape=SHAPE):
    msg = protocol.CacheGet(transfer_id=tid, worker_id="client-0", retention=retention, block_hashes=hashes,
                            token_ids=token_ids if token_ids is not None else tokens(len(hashes)), block_size=BS,
                            dtype="float32", block_shape=shape, transports=["stream"])
    reply = protocol.decode_reply((await nc.request(subjects.cache("get", TIER_ID), protocol.encode(msg),
                                                    timeout=5)).data, protocol.CacheGetReply)
    if reply.num_blocks == 0:
        return reply, None
    receiver = StreamTransport(nc, "client-r")
    try:
        data = await receiver.fetch(reply.handle, timeout=5)
    finally:
        await receiver.close()
        await nc.publish(subjects.cache("release", TIER_ID), protocol.encode(protocol.CacheRelease(transfer_id=tid)))
    return reply, data


async def test_put_then_get_round_trips_exact_bytes_and_publishes_kv_events(tier, nc, sender):
    events = []
    sub = await listen(nc, events)
    payload = kv(3)
    assert (await put(nc, sender, "p1", [11, 12, 13], payload)).detail == "3 new"
    reply, data = await get(nc, "g1", [11, 12, 13])
    assert reply.num_blocks == 3 and torch.equal(data, payload)
    reply, data = await get(nc, "g2", [11, 12, 99])              # leading run only
    assert reply.num_blocks == 2 and torch.equal(data, payload[:2])
    assert await wait_until(lambda: any(e.kind == "stored" and e.tier == "cache_tier" and
                                        set(e.block_hashes) >= {11, 12, 13} for e in events))
    await sub.unsubscribe()
    assert await wait_until(lambda: tier.staged_gets() == 0)     # released


async def test_bad_input_gets_an_error_and_loses_nothing(tier, nc, sender):
    payload = kv(2, seed=1)
    await put(nc, sender, "keep", [1, 2], payload)

    async def error_of(subject_op: str, data: bytes) -> str:
        subject = subjects.cache_put(TIER_ID, "client-0") if subject_op == "put" else subjects.cache(subject_op, TIER_ID)
        reply = await nc.request(subject, data, timeout=5)
        return protocol.decode(reply.data, protocol.ErrorReply).code

    assert await error_of("put", b"\xc1garbage") == "invalid_request"
    assert await error_of("get", msgpack.packb({"v": 1, "type": "CacheGet"})) == "invalid_request"
    assert await error_of("put", msgpack.packb({"v": 9, "type": "CachePut"})) == "unsupported_version"
    with pytest.raises(DeepinferError) as info:                   # handle [2, ...] vs header of 3 blocks
        await put(nc, sender, "bad1", [5, 6, 7], payload)
    assert info.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(DeepinferError) as info:                   # another block shape than the payload's
        await put(nc, sender, "bad2", [5, 6], payload, block_shape=[2, 2, 4, 3, 1])
    assert info.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(DeepinferError) as info:
        await put(nc, sender, "bad3", [5, 6], payload, retention="forever")
    assert info.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(DeepinferError) as info:                   # blocks over the tier's max block size
        big = torch.zeros((1, 3 << 20))                            # 12 MiB > segment_mb (4) / 2
        await put(nc, sender, "bad4", [8], big, block_shape=[3 << 20], token_ids=tokens(1))
    assert info.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    with pytest.raises(DeepinferError) as info:                   # the body names another writer than the subject
        await put(nc, sender, "bad5", [5, 6], payload, writer="decode-0", worker_id="decode-1")
    assert info.value.code == ErrorCode.INVALID_REQUEST
    assert (await get(nc, "g-unknown", [424242]))[0].num_blocks == 0          # unknown hash: nothing
    assert (await get(nc, "g-tokens", [1, 2], tokens(2, offset=1)))[0].num_blocks == 0  # other tokens
    assert (await get(nc, "g-shape", [1, 2], shape=[2, 2, 4, 3, 1]))[0].num_blocks == 0  # other layout
    with pytest.raises(DeepinferError):
        await get(nc, "g-class", [1, 2], retention="forever")
    reply, data = await get(nc, "g-ok", [1, 2])                    # what was stored is intact
    assert reply.num_blocks == 2 and torch.equal(data, payload)
    assert tier.store.stats()["dram_blocks"] + tier.store.stats()["ssd_blocks"] == 2


async def test_stats_report_store_and_ledger(tier, nc, sender):
    await put(nc, sender, "p", [21, 22], kv(2), tenant="acme", retention="agent")
    await get(nc, "g", [21, 22, 23], retention="agent")
    reply = await nc.request(subjects.stats(TIER_ID), protocol.encode(protocol.StatsRequest()), timeout=5)
    stats = protocol.decode(reply.data, protocol.StatsReply).stats
    assert stats["store"]["dram_hits"] == 2
    line = stats["ledger"]["by_tenant"]["default"]["agent"]       # the get named no tenant
    assert line["blocks_hit_dram"] == 2 and line["blocks_missed"] == 1
    assert stats["ledger"]["by_tenant"]["acme"]["agent"]["blocks_written"] == 2


async def test_gc_removals_reach_the_kv_events(nats_server, nc, sender, tmp_path):
    """A block whose class expires is removed by GC and announced as removed."""
    service = CacheTierService(tier_config(nats_server.url, tmp_path, transports="stream",
                                           retention="chat=7d,agent=3d,none=0,short=1s", gc_interval_s=0.2))
    await service.start()
    events = []
    sub = await listen(nc, events)
    try:
        await put(nc, sender, "s", [31], kv(1), retention="short")
        assert await wait_until(lambda: any(e.kind == "removed" and 31 in e.block_hashes for e in events), 5)
        assert (await get(nc, "g", [31]))[0].num_blocks == 0
    finally:
        await sub.unsubscribe()
        await service.shutdown()


async def test_a_held_block_keeps_its_first_writers_bytes_and_every_put_is_attributed(tier, nc, sender):
    """A later put of the same blocks (same hashes, tokens, digests) with other bytes (a forger, or a worker
    whose arithmetic differs) never replaces what others are served: counted as a conflict, attributed."""
    good, forged = kv(2, seed=3), kv(2, seed=4)
    await put(nc, sender, "first", [41, 42], good, writer="decode-0")
    assert (await put(nc, sender, "forged", [41, 42], forged, writer="decode-1")).detail == "0 new"
    reply, data = await get(nc, "g", [41, 42])
    assert reply.num_blocks == 2 and torch.equal(data, good)
    await tier.store.flush()   # also from SSD: the record keeps its writer, the first bytes stay
    held = await tier.store._on_ssd(tier.store._ssd.get, 41, tokens(1), "chat")
    assert held is not None and held[0].writer == "decode-0"
    stats = tier.store.stats()
    assert stats["put_conflicts"] == 2
    ledger = tier.ledger.as_dict()["by_writer"]
    assert ledger["decode-0"]["blocks_written"] == 2 and ledger["decode-1"]["blocks_written"] == 2
