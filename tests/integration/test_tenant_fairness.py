"""Two tenants, one flooding, through the real router (issue 21): the other is served next, not after the flood;
a tenant over its in-flight limit is refused (overloaded) without touching the others."""
from __future__ import annotations

import asyncio

import pytest

from shared import protocol
from shared.client import generate
from shared.errors import DeepinferError, ErrorCode
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, wait_until
from tests.model_factory import write_tiny_hf_folder

FLOOD = 24
SEQS = 4  # the decode worker's batch: the router's dispatch window


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=1024,
                                num_layers=4, hidden=128, ffn=256)


def request(i: int, max_tokens: int) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=[3 + i % 50, 4, 5, 6, 7, 8], max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True, prefill_mode="local")


async def flood_then_one(url: str, router) -> tuple[int, int]:
    """``flood`` sends FLOOD requests at once; once the router holds them all, ``calm`` sends one. Returns how
    many flood requests were still unfinished when the calm one arrived, and how many of those finished before
    it. (Waiting on the router, not a fixed sleep: on a fast host a third of the flood finished within 0.3 s.)"""
    nc = await connect(url)
    done: list[str] = []
    try:
        async def one(name: str, tenant: str, req: protocol.GenerateRequest) -> None:
            await generate(nc, req, tenant=tenant)
            done.append(name)
        flood = [asyncio.create_task(one(f"flood-{i}", "flood", request(i, 96))) for i in range(FLOOD)]
        # the flood is in: SEQS run, the rest wait (at the router, or in the engine)
        assert await wait_until(lambda: len(router.relays) + len(done) >= FLOOD)
        pending = FLOOD - len(done)
        await one("calm", "calm", request(99, 4))
        overtook = done.index("calm") - (FLOOD - pending)
        await asyncio.gather(*flood)
    finally:
        await nc.close()
    return pending, overtook


@pytest.mark.parametrize("window", [0, -1], ids=["fair gate", "no gate"])
async def test_a_tenant_arriving_during_a_flood_is_served_next(nats_server, folder, window):
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, max_num_seqs=SEQS,
                                kv_cache_mb=16, router_kw={"dispatch_window": window}) as cluster:
        pending, overtook = await flood_then_one(nats_server.url, cluster.router)
        assert cluster.router.gate.dispatched == 0 and cluster.router.gate.held == {}
    assert pending >= FLOOD // 2, "the flood must still be queued when the calm request arrives"
    if window == 0:
        assert overtook <= 2 * SEQS, (pending, overtook)  # it took one of the next free slots (measured: 4)
    else:
        assert overtook >= pending - SEQS, (pending, overtook)  # without the gate: behind the whole flood (20 of 20)


async def test_a_tenant_over_its_limit_is_refused_and_the_other_is_served(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, max_num_seqs=SEQS, kv_cache_mb=16,
                                router_kw={"tenant_max_inflight": FLOOD - 4}) as cluster:
        nc = await connect(nats_server.url)
        try:
            results = await asyncio.gather(*(generate(nc, request(i, 16), tenant="flood") for i in range(FLOOD)),
                                           generate(nc, request(99, 4), tenant="calm"), return_exceptions=True)
        finally:
            await nc.close()
        refused = [r for r in results[:FLOOD] if isinstance(r, DeepinferError)]
        assert len(refused) == 4 and all(r.code == ErrorCode.OVERLOADED and "flood" in r.message for r in refused)
        assert not isinstance(results[-1], BaseException) and len(results[-1][0]) == 4
        ledger = cluster.router.ledger.as_dict()["by_tenant"]
        assert ledger["flood"]["agent"]["requests"] == FLOOD - 4 and ledger["calm"]["agent"]["requests"] == 1
