"""The router's tables without a server: worker liveness, draining and pruning; in-flight
accounting; the bounded sweep of the KV index; KV-event coalescing and requeue on publish failure."""
import time

import pytest

from shared.kv_events import KVEventPublisher, _coalesce
from services.router.service import RouterService
from services.router.workers import InflightAccount, WorkerTable
from shared import protocol
from services.router.config import RouterConfig
from shared.errors import DeepinferError, ErrorCode


def report(wid: str, role: str = "decode", host: str = "h1", transports=("shm", "stream"), **kw):
    fields = dict(worker_id=wid, role=role, model_id="m", num_running=0, num_waiting=0, kv_usage=0.0,
                  num_free_blocks=10, num_total_blocks=10, block_size=16, transports=list(transports), host=host,
                  timestamp=0.0)
    return protocol.LoadReport(**{**fields, **kw})


def test_alive_excludes_draining_but_streams_still_see_them_alive():
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("d0"), now=0.0)
    table.update(report("d1", draining=True), now=0.0)
    assert [s.report.worker_id for s in table.alive("decode", now=1.0)] == ["d0"]
    assert table.is_alive("d1", now=1.0)  # its running streams are still watched as alive
    assert not table.is_alive("d0", now=3.0)


def test_a_worker_back_from_the_dead_takes_work_only_after_unbroken_heartbeats():
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("d0"), now=0.0)
    assert [s.report.worker_id for s in table.alive("decode", now=0.0)] == ["d0"]  # new: at once
    table.update(report("d0"), now=10.0)        # silent for 10 s (a cut link), then its buffered beats arrive
    assert table.is_alive("d0", now=10.5)        # streams still count it
    assert table.alive("decode", now=10.5) == []
    table.update(report("d0"), now=11.0)
    table.update(report("d0"), now=12.0)
    assert table.alive("decode", now=12.9) == []
    table.update(report("d0"), now=13.0)
    assert [s.report.worker_id for s in table.alive("decode", now=13.0)] == ["d0"]  # 3 s unbroken
    table.update(report("d0"), now=20.0)        # another silence restarts the wait
    assert table.alive("decode", now=20.0) == []


def test_a_silence_spanning_the_routers_own_reconnect_is_not_the_workers():
    """After a NATS restart the router missed every heartbeat: its workers take work as soon as they beat again
    (found by the chaos test: "no decode worker is alive" for 3 s after each NATS restart)."""
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("d0"), now=0.0)
    table.update(report("d1"), now=0.0)
    table.router_reconnected(now=4.0)            # the router was away 0.5..4.0
    table.update(report("d0"), now=4.2)
    assert [s.report.worker_id for s in table.alive("decode", now=4.2)] == ["d0"]
    table.update(report("d1"), now=10.0)         # d1 stayed silent long after the router was back: its own silence
    assert [s.report.worker_id for s in table.alive("decode", now=10.0)] == []


def test_prune_forgets_workers_dead_past_forget_after():
    table = WorkerTable(dead_after_s=1.0, forget_after_s=5.0)
    for i in range(100):  # restarts under fresh random ids
        table.update(report(f"decode-{i}"), now=float(i) * 0.1)
    table.update(report("alive"), now=14.0)
    gone = table.prune(now=15.0)
    assert len(gone) == 100 and list(table.workers) == ["alive"]
    assert table.prune(now=15.0) == []


def test_inflight_account_counts_until_first_token_and_close():
    table = WorkerTable(3.0)
    table.update(report("p", role="prefill"), now=0.0)
    table.update(report("d"), now=0.0)
    p, d = table.workers["p"], table.workers["d"]
    account = InflightAccount(p, d, 100)
    assert (p.inflight, d.inflight, p.inflight_tokens, d.inflight_tokens) == (1, 1, 100, 0)
    account.prefill_done()
    account.prefill_done()
    assert p.inflight_tokens == 0 and p.inflight == 1
    account.close()
    account.close()
    assert (p.inflight, d.inflight, p.inflight_tokens) == (0, 0, 0)
    local = InflightAccount(None, d, 40)  # local prefill: the decode worker computes the prompt
    assert d.inflight_tokens == 40
    local.close()
    assert d.inflight_tokens == 0 and d.inflight == 0


def event(wid: str, seq: int, hashes=(1, 2)) -> protocol.KVEvent:
    return protocol.KVEvent(worker_id=wid, seq=seq, kind="stored", block_hashes=list(hashes))


def test_sweep_bounds_the_index_and_table():
    router = RouterService(RouterConfig(worker_dead_after_s=1.0))
    router.table.update(report("d0"), now=time.monotonic() - 2.0)  # silent for 2 s: dead, not yet forgotten
    router.index.apply(event("d0", 1))
    router.index.apply(event("ghost", 1))  # known only from events, never heartbeated
    router.sweep()
    assert "d0" not in router.index.worker_ids()  # dead: dropped at once
    assert "ghost" in router.index.worker_ids()  # may heartbeat soon: one sweep of grace
    router.sweep()
    assert router.index.worker_ids() == []
    assert "d0" in router.table.workers
    router.table.workers["d0"].last_seen -= 100.0
    router.index.apply(event("d0", 2))
    router.sweep()
    assert router.table.workers == {} and router.index.worker_ids() == []


def test_kv_event_tier_is_a_closed_set():
    with pytest.raises(DeepinferError) as err:
        protocol.KVEvent(worker_id="w", seq=1, kind="stored", block_hashes=[1], tier="gpu-ish")
    assert err.value.code == ErrorCode.INVALID_REQUEST and "tier" in err.value.message
    for tier in protocol.KV_TIERS:
        protocol.KVEvent(worker_id="w", seq=1, kind="stored", block_hashes=[1], tier=tier)


def test_coalesce_merges_runs_of_one_kind_and_splits_big_ones():
    batch = [("stored", [1]), ("stored", [2, 3]), ("removed", [1]), ("cleared", []), ("cleared", []),
             ("stored", list(range(10)))]
    assert list(_coalesce(batch, max_hashes=4)) == [
        ("stored", [1, 2, 3]), ("removed", [1]), ("cleared", []), ("cleared", []),
        ("stored", list(range(10)))]
    assert list(_coalesce([("stored", [1, 2, 3]), ("stored", [4, 5])], max_hashes=4)) == [
        ("stored", [1, 2, 3]), ("stored", [4, 5])]


class FlakyNats:
    """Fault injection: the first ``failures`` publishes raise, later ones are recorded."""

    def __init__(self, failures: int, during_failure=None) -> None:
        self.failures, self.sent, self.during_failure = failures, [], during_failure

    async def publish(self, subject, data):
        if self.failures:
            self.failures -= 1
            if self.during_failure is not None:
                self.during_failure()
            raise ConnectionError("injected: nats down")
        self.sent.append(protocol.decode(data, protocol.KVEvent))


async def test_kv_event_publish_failure_keeps_the_batch():
    nc = FlakyNats(failures=1)
    pub = KVEventPublisher(nc, "w", snapshot_fn=None)
    pub.sink("stored", [1, 2])
    pub.sink("removed", [1])
    with pytest.raises(ConnectionError):
        await pub.flush()
    assert pub.seq == 0  # nothing went out
    pub.sink("stored", [3])
    await pub.flush()
    assert [(e.seq, e.kind, e.block_hashes) for e in nc.sent] == [
        (1, "stored", [1, 2]), (2, "removed", [1]), (3, "stored", [3])]


async def test_kv_event_requeue_overflow_forces_a_resync_gap():
    nc = FlakyNats(failures=1)
    pub = KVEventPublisher(nc, "w", snapshot_fn=None, max_pending=2)
    nc.during_failure = lambda: (pub.sink("stored", [2]), pub.sink("stored", [3]))  # the engine goes on
    pub.sink("stored", [1])
    pub.sink("removed", [1])
    with pytest.raises(ConnectionError):
        await pub.flush()  # requeueing 2 events next to 2 new ones would overflow max_pending=2
    pub.sink("stored", [4])
    await pub.flush()
    assert [(e.seq, e.block_hashes) for e in nc.sent] == [(2, [4])]  # seq 1 skipped: the index resyncs


def test_tier_pull_cost_is_what_the_workers_measured():
    """Placement prices a cache-tier pull with the workers' measured seconds per block (their mean), and with
    the profile's figure until one has pulled."""
    from services.router.placement import Placer
    from services.router.policy.kv_index import KVIndex
    from services.router.policy.types import CostModel

    table = WorkerTable(3.0)
    placer = Placer("predictive", table, KVIndex(), CostModel(block_transfer_s=1e-3), 0)
    for wid, cost in (("p", 0.0), ("d1", 2e-4), ("d2", 4e-4)):
        table.update(report(wid, "prefill" if wid == "p" else "decode", tier_block_s=cost))
    states = list(table.workers.values())
    assert placer.tier_cost(states[:1]).block_transfer_s == 1e-3
    assert placer.tier_cost(states).block_transfer_s == pytest.approx(3e-4)


async def test_a_cancel_reaches_only_requests_of_its_namespace():
    import asyncio
    from types import SimpleNamespace

    from shared import subjects

    router = RouterService(RouterConfig())
    tasks = {rid: asyncio.create_task(asyncio.sleep(30)) for rid in ("plain", "acme-req", "beta-req", "cmpl-http")}
    router.relays.update(tasks)
    router.owners.update({"plain": ("nats", None), "acme-req": ("nats", "acme"), "beta-req": ("nats", "beta"),
                          "cmpl-http": ("http", None)})

    async def cancel(subject: str, rid: str) -> None:
        await router.on_cancel(SimpleNamespace(subject=subject, data=protocol.encode(
            protocol.CancelRequest(request_id=rid))))
        await asyncio.sleep(0)

    await cancel(subjects.cancel_as("beta"), "acme-req")  # another tenant's request: untouched
    await cancel(subjects.CANCEL, "beta-req")  # the plain API cannot reach a tenant's request
    await cancel(subjects.cancel_as("acme"), "plain")
    await cancel(subjects.CANCEL, "cmpl-http")  # an HTTP request (no API keys) is not NATS clients' to cancel
    assert not any(t.cancelled() for t in tasks.values())
    await cancel(subjects.cancel_as("acme"), "acme-req")
    await cancel(subjects.CANCEL, "plain")
    assert tasks["acme-req"].cancelled() and tasks["plain"].cancelled() and not tasks["beta-req"].cancelled()
    assert not tasks["cmpl-http"].cancelled()
    tasks["beta-req"].cancel()
    tasks["cmpl-http"].cancel()


def test_before_any_pull_the_tier_cost_scales_with_the_workers_block_bytes():
    """An MLA model's latent blocks (a fraction of the profile model's bytes) are priced at their size until the
    workers measured a pull; a model of the profile's block size keeps the profile's figure."""
    from services.router.placement import Placer
    from services.router.policy.kv_index import KVIndex
    from services.router.policy.types import CostModel

    table = WorkerTable(3.0)
    placer = Placer("predictive", table, KVIndex(), CostModel(block_transfer_s=1e-3, block_bytes=40_000), 0)
    table.update(report("d1", "decode", block_bytes=10_000))
    table.update(report("d2", "decode", block_bytes=40_000))
    d1, d2 = (table.workers[w] for w in ("d1", "d2"))
    assert placer.tier_cost([d1]).block_transfer_s == pytest.approx(2.5e-4)
    assert placer.tier_cost([d2]).block_transfer_s == pytest.approx(1e-3)
    table.update(report("d1", "decode", block_bytes=10_000, tier_block_s=5e-5))
    assert placer.tier_cost([table.workers["d1"]]).block_transfer_s == pytest.approx(5e-5)   # measured wins


def test_with_no_worker_past_its_rejoin_wait_a_heartbeating_one_is_placeable():
    """``alive`` keeps a worker back after a silence (rejoin wait); ``placeable`` offers it when no other worker of
    its role is alive (a late heartbeat on a loaded host must not refuse every request for 3 s), and only while it
    beats; ``known`` still names a silent one (the relay waits for it), not a draining one."""
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("d0"), now=0.0)
    table.update(report("d0"), now=5.0)                          # late: a rejoin wait starts
    assert table.alive("decode", now=5.1) == []
    assert [s.report.worker_id for s in table.placeable("decode", now=5.1)] == ["d0"]
    table.update(report("d1"), now=5.1)                          # a steady worker exists: it alone is placeable
    assert [s.report.worker_id for s in table.placeable("decode", now=5.2)] == ["d1"]
    assert table.placeable("decode", now=20.0) == [] and table.known("decode")
    table.update(report("d0", draining=True), now=20.0)
    table.update(report("d1", draining=True), now=20.0)
    assert not table.known("decode")


def test_a_restarted_process_under_the_same_id_takes_work_at_once():
    """A heartbeat naming another ``instance`` is a new process (a restart), not a flapping link: no rejoin
    wait; the same instance back after a silence still waits."""
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("d0", instance="a"), now=0.0)
    table.update(report("d0", instance="b"), now=20.0)
    assert [s.report.worker_id for s in table.alive("decode", now=20.0)] == ["d0"]
    table.update(report("d0", instance="b"), now=40.0)
    assert table.alive("decode", now=40.0) == []
