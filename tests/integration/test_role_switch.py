"""Switchable workers and the online P:D planner (issue 20), through the real router and workers over a real
nats-server: a worker switches role under load without reloading its model (its decode streams live-migrate
away, nothing lost, no re-prefill), then serves its new role exactly; the planner makes that switch itself when
prefill is short and decode has room, reports it, and does not flap."""
import asyncio

import pytest

from services.router.stats import router_stats
from cli import status
from shared import protocol, subjects
from shared.client import generate
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs, wait_until
from tests.integration.test_live_migration import collect, prompts, request
from tests.model_factory import write_tiny_hf_folder

TOKENS = 400
ORDERS_ONLY = {"migrate_skew_min": 0, "migrate_kv_high": 2.0}  # streams move only because a worker drains


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=2048)


async def switch(nc, worker: str, role: str) -> protocol.Ack:
    reply = await nc.request(subjects.ctl(worker, "role"), protocol.encode(protocol.RoleSwitch(role=role)),
                             timeout=60)
    return protocol.decode_reply(reply.data, protocol.Ack)


def roles(cluster) -> dict[str, str]:
    return {wid: s.report.role for wid, s in cluster.router.table.workers.items() if wid.startswith("worker-")}


async def test_a_worker_switches_role_under_load_and_serves_the_new_role_exactly(nats_server, folder):
    ps = prompts(6)
    expected = reference_outputs(folder, ps, TOKENS)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm,stream",
                                switchable=True, router_kw=ORDERS_ONLY) as cluster:
        nc = await connect(nats_server.url)
        try:
            started = [asyncio.Event() for _ in ps[:4]]
            tasks = [asyncio.create_task(collect(nc, request(p, f"s{i}", max_tokens=TOKENS), started[i]))
                     for i, p in enumerate(ps[:4])]
            for ev in started:
                await asyncio.wait_for(ev.wait(), 30)
            on_w1 = {rid for rid, s in cluster.router.relay.live.items() if s.attempt.decode_w.report.worker_id
                     == "worker-1"}
            assert on_w1, "no stream decoded on worker-1"
            assert (await switch(nc, "worker-1", "prefill")).detail == "prefill"   # decode -> prefill, under load
            assert (await switch(nc, "worker-0", "decode")).detail == "decode"     # the old prefill worker
            assert await wait_until(lambda: roles(cluster) == {"worker-0": "decode", "worker-1": "prefill",
                                                               "worker-2": "decode"})
            results = await asyncio.gather(*tasks)
            later = await asyncio.gather(*(generate(nc, request(p, f"n{i}", max_tokens=TOKENS))
                                           for i, p in enumerate(ps[4:], start=4)))
        finally:
            await nc.close()
        for i, chunks in enumerate(results):
            assert [c.seq for c in chunks] == list(range(len(chunks)))
            assert [t for c in chunks for t in c.token_ids] == expected[i], f"stream {i} diverged"
            assert chunks[-1].usage.get("migrations", 0) == int(f"s{i}" in on_w1), chunks[-1].usage
        assert [out[0] for out in later] == expected[4:]                 # prefilled by worker-1 now
        w0, w1, w2 = cluster.workers
        assert w1.role_switches == 1 and w0.role_switches == 1 and w2.role_switches == 0
        assert w1.metrics.prompt_tokens._value.get() > 0                       # it prefilled in its new role
        assert w1.desk.sent == len(on_w1) and w1.desk.failed == 0              # its streams moved, none handed back
        assert sum(w.engine.num_preemptions for w in cluster.workers) == 0


async def test_the_planner_moves_a_decode_worker_to_prefill_when_prefill_is_short(nats_server, folder):
    long_prompts = [[(13 * i + 5 * j) % 250 + 3 for j in range(320)] for i in range(10)]
    expected = reference_outputs(folder, long_prompts, 24)
    planner = {"planner": True, "planner_ttft_slo_s": 0.02, "planner_tpot_slo_s": 100.0, "planner_sustain": 2,
               "planner_interval_s": 0.2, "planner_cooldown_s": 30.0, **ORDERS_ONLY}
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm,stream",
                                switchable=True, router_kw=planner) as cluster:
        nc = await connect(nats_server.url)
        try:
            results = await asyncio.gather(*(generate(nc, request(p, f"p{i}", max_tokens=24))
                                             for i, p in enumerate(long_prompts)))
            plan = cluster.router.planner
            assert await wait_until(lambda: not plan.busy and plan.planner.counts, timeout=30)
            await asyncio.sleep(2.0)  # idle now: nothing more happens (cooldown, and the band between low and high)
        finally:
            await nc.close()
        assert [out[0] for out in results] == expected
        assert plan.planner.counts == {("switch", "prefill", "prefill_pressure"): 1}, plan.stats()
        (decision,) = plan.planner.history
        assert decision.worker_id in ("worker-1", "worker-2") and decision.prefill_pressure >= 0.8
        assert roles(cluster)[decision.worker_id] == "prefill" and plan.failed == 0
        body, _ = cluster.router.render_metrics()
        assert (b'deepinfer_router_planner_decisions_total{kind="switch",reason="prefill_pressure",role="prefill"}'
                b' 1.0') in body
        stats = router_stats(cluster.router)  # what `deepinfer status` shows
        assert stats["workers"][decision.worker_id]["switchable"] and stats["planner"]["leader"]
        text = "\n".join(status._elastic_lines(cluster.router.config.worker_id, stats))
        assert f"switch {decision.worker_id} -> prefill" in text and "prefill_pressure" in text
