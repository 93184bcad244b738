"""Speculative decoding in the served path (real NATS, in-process services, tiny float64 model): greedy output
through prefill→decode hand-off equals the single-process engine's with an in-process drafter and with the
draft service; a dead or slow draft service changes nothing but speed; a stream handed back mid-way by a
speculating worker continues exactly; usage reports the speculation."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.draft.service import DraftService
from shared import protocol
from services.draft.config import DraftConfig
from tests.integration.services_harness import (InProcessCluster, all_blocks_free, generate_once,
                                                reference_outputs, wait_until)
from tests.model_factory import write_tiny_hf_folder
from tests.unit.test_metrics import scrape, value

# repetitive prompts: prompt lookup finds matches, so proposals are partly accepted
PROMPTS = [[(i % 7) * 11 + 3 for i in range(40)], [(i * 5) % 97 + 1 for i in range(29)], list(range(50, 83))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=512)


@pytest.fixture(scope="module")
def expected(folder):
    return reference_outputs(folder, PROMPTS, MAX_TOKENS)


def request(prompt, **kw) -> protocol.GenerateRequest:
    kw = {"max_tokens": MAX_TOKENS, "prefill_mode": "remote", **kw}
    return protocol.GenerateRequest(prompt_token_ids=prompt, temperature=0.0, ignore_eos=True, **kw)


class SlowDrafter:
    """Fault injection: the wrapped drafter, ``delay_s`` late."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s, self.name = inner, delay_s, "slow"

    def propose(self, sequences, k):
        time.sleep(self.delay_s)
        return self.inner.propose(sequences, k)


async def run_all(url, **kw):
    return await asyncio.gather(*(generate_once(url, request(p, **kw)) for p in PROMPTS))


@pytest.mark.parametrize("drafter", ["prompt_lookup", "self:1"])
async def test_local_drafter_is_exact_through_the_handoff(nats_server, folder, expected, drafter):
    async with InProcessCluster(nats_server.url, folder, draft="local", drafter=drafter) as cluster:
        results = await run_all(nats_server.url)
        assert [tokens for tokens, _, _ in results] == expected
        spec = cluster.workers[1].engine.speculator.stats()
        assert spec["drafted"] > 0 and spec["proposals"] > 0
        usage = [u for _, _, u in results]
        assert sum(u.get("spec_drafted_tokens", 0) for u in usage) == spec["drafted"]
        if drafter == "self:1":
            assert spec["accepted"] > 0
        assert await wait_until(lambda: all_blocks_free(cluster))
        # per-request opt-out: no drafting at all for these
        before = spec["drafted"]
        results = await run_all(nats_server.url, speculative=False, prefill_mode="local")
        assert [tokens for tokens, _, _ in results] == expected
        assert cluster.workers[1].engine.speculator.stats()["drafted"] == before


async def test_draft_service_is_exact_and_a_dead_or_slow_one_changes_nothing(nats_server, folder, expected):
    service = DraftService(DraftConfig(nats_url=nats_server.url, worker_id="draft-0", model=str(folder),
                                       drafter="self:1", dtype="float64", threads=1, heartbeat_s=0.2))
    await service.start()
    try:
        async with InProcessCluster(nats_server.url, folder, draft="remote", draft_timeout_s=2.0) as cluster:
            results = await run_all(nats_server.url)
            assert [tokens for tokens, _, _ in results] == expected
            spec = cluster.workers[1].engine.speculator
            assert spec.stats()["drafted"] > 0 and service.served > 0
            service.drafter = SlowDrafter(service.drafter, delay_s=3.0)   # misses every 2 s deadline
            drafted = spec.stats()["drafted"]
            results = await run_all(nats_server.url)
            assert [tokens for tokens, _, _ in results] == expected
            assert spec.stats()["drafted"] == drafted      # nothing verified without proposals in time
            assert spec.drafter.timeouts > 0
            samples = scrape(cluster.workers[1].metrics.registry)
            assert value(samples, "deepinfer_worker_spec_draft_errors_total", cause="timeout") == spec.drafter.timeouts
            assert value(samples, "deepinfer_worker_spec_draft_wait_seconds_total") == spec.drafter.waited_s > 0
            await service.shutdown()                       # and then none at all
            t0 = time.monotonic()
            results = await run_all(nats_server.url)
            assert [tokens for tokens, _, _ in results] == expected
            assert spec.stats()["drafted"] == drafted
            assert time.monotonic() - t0 < 30
    finally:
        await service.shutdown()


async def test_a_handed_back_speculating_stream_continues_exactly(nats_server, folder, expected):
    async with InProcessCluster(nats_server.url, folder, decode=2, draft="local", drafter="self:1",
                                drain_grace_s=0.0, router_kw={"migrate_on_drain": False}) as cluster:
        decode0 = cluster.workers[1]
        task = asyncio.create_task(generate_once(nats_server.url, request(PROMPTS[0], max_tokens=200)))
        assert await wait_until(lambda: bool(decode0.active) or bool(cluster.workers[2].active), 20)
        serving = decode0 if decode0.active else cluster.workers[2]
        await asyncio.sleep(0.2)
        await serving.shutdown()                           # hands the stream back mid-way
        tokens, _, usage = await asyncio.wait_for(task, 60)
        assert tokens == reference_outputs(folder, [PROMPTS[0]], 200)[0]
        assert usage["failovers"] == 1
