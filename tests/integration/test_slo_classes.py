"""SLO classes through the real router and a decode worker (issue 34): under a batch flood that fills the router
(``max_inflight``) and the engine's seats, an interactive trickle is admitted (a waiting batch request is shed
with ``overloaded`` for one that finds the router full), dispatched beyond the full window, and started at once by the engine's priority
scheduling (a batch sequence preempted for its seat); nothing is lost: every request is answered, exact, or
refused with a code; ``usage`` and the metrics name each request's class."""
from __future__ import annotations

import asyncio
from dataclasses import replace as dataclass_replace
import time

import pytest

from shared import protocol
from shared.client import generate
from shared.errors import DeepinferError, ErrorCode
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs, wait_until
from tests.model_factory import write_tiny_hf_folder

FLOOD, TRICKLE, SEQS, MAX_INFLIGHT = 20, 6, 4, 12
BATCH_TOKENS, CHAT_TOKENS = 64, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=1024,
                                num_layers=4, hidden=128, ffn=256)


def prompt(i: int) -> list[int]:
    return [3 + i % 50, 4 + i % 7, 5, 6, 7, 8, 9 + i % 11]


def request(i: int, max_tokens: int, slo_class: str) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt(i), max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, prefill_mode="local", slo_class=slo_class, timeout_s=120.0)


async def test_an_interactive_trickle_starts_at_once_through_a_batch_flood_and_nothing_is_lost(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, max_num_seqs=SEQS, kv_cache_mb=16,
                                router_kw={"max_inflight": MAX_INFLIGHT, "tenant_max_inflight": MAX_INFLIGHT},
                                scheduling_policy="priority") as cluster:
        router, decode = cluster.router, cluster.workers[0]
        nc = await connect(nats_server.url)
        try:
            async def one(i: int, max_tokens: int, slo_class: str):
                try:
                    return await generate(nc, request(i, max_tokens, slo_class))
                except DeepinferError as err:
                    return err
            flood = [asyncio.create_task(one(i, BATCH_TOKENS, "batch")) for i in range(FLOOD)]
            assert await wait_until(lambda: len(router.relays) == MAX_INFLIGHT and router.gate.num_waiting > 0)
            chats, sent_at = [], []
            for j in range(TRICKLE):
                sent_at.append(time.monotonic())
                chats.append(await one(100 + j, CHAT_TOKENS, "interactive"))
                await asyncio.sleep(0.05)
            batch = await asyncio.gather(*flood)
            scrape = router.metrics.render()[0].decode()
        finally:
            await nc.close()
        preemptions = decode.engine.num_preemptions
        assert router.gate.dispatched == 0 and router.gate.held == {}
    refused = [r for r in batch if isinstance(r, DeepinferError)]
    served = [(i, r) for i, r in enumerate(batch) if not isinstance(r, DeepinferError)]
    assert all(r.code == ErrorCode.OVERLOADED for r in refused) and len(refused) + len(served) == FLOOD
    shed = [r for r in refused if "more urgent" in r.message]
    assert 1 <= len(shed) <= TRICKLE, [r.message for r in refused]   # the first found the router full
    assert all(not isinstance(c, DeepinferError) for c in chats), chats
    assert preemptions >= 1   # a batch sequence gave its seat back
    ttfts = sorted(usage["ttft_ms"] / 1000.0 for _, _, usage in chats)
    batch_ttft = sorted(usage["ttft_ms"] / 1000.0 for _, (_, _, usage) in served)
    print(f"interactive TTFT p50 {ttfts[len(ttfts) // 2]:.3f} s max {ttfts[-1]:.3f} s; batch TTFT p50 "
          f"{batch_ttft[len(batch_ttft) // 2]:.3f} s max {batch_ttft[-1]:.3f} s; {len(served)} batch served, "
          f"{len(refused)} refused ({len(shed)} shed); {preemptions} preemptions")
    assert ttfts[-1] < 1.0, ttfts   # the interactive class's target, every one of them
    assert ttfts[-1] < batch_ttft[-1]
    assert all(u["slo_class"] == "interactive" for _, _, u in chats) and all(
        u["slo_class"] == "batch" for _, (_, _, u) in served)
    want = reference_outputs(folder, [prompt(i) for i, _ in served] + [prompt(100 + j) for j in range(TRICKLE)],
                             BATCH_TOKENS)
    got = [ids for _, (ids, _, _) in served] + [ids for ids, _, _ in chats]
    assert got[:len(served)] == want[:len(served)]                                   # preempted ones too
    assert [g for g in got[len(served):]] == [w[:CHAT_TOKENS] for w in want[len(served):]]
    assert f'deepinfer_router_slo_requests_total{{slo_class="interactive",tpot="met",ttft="met"}} {TRICKLE}.0' \
        in scrape or 'slo_class="interactive"' in scrape
    assert 'deepinfer_router_rejected_total{reason="shed"}' in scrape


async def test_a_requests_class_by_field_tier_and_tenant_and_an_unknown_one_is_refused(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1,
                                router_kw={"tenant_classes": "etl=batch"}):
        nc = await connect(nats_server.url)
        try:
            plain = await generate(nc, request(1, 4, ""))
            tier = await generate(nc, dataclass_replace(request(2, 4, ""), service_tier="priority"))
            capped = await generate(nc, request(3, 4, "interactive"), tenant="etl")
            with pytest.raises(DeepinferError) as err:
                await generate(nc, request(4, 4, "gold"))
            from cli.replay import replay   # `deepinfer bench --classes`: each replayed request names its class
            replayed = await replay(nc, [(0.0, prompt(5), 3), (0.01, prompt(6), 3)], timeout_s=30,
                                    slo_classes=["batch", "gold"])
        finally:
            await nc.close()
    assert [u["slo_class"] for _, _, u in (plain, tier, capped)] == ["standard", "interactive", "batch"]
    assert err.value.code == ErrorCode.INVALID_REQUEST and "gold" in err.value.message
    assert [(r["slo_class"], r["error"], r["output_tokens"]) for r in replayed] == [
        ("batch", None, 3), ("gold", "invalid_request", 0)]
