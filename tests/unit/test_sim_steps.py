"""The simulator's step events (simulator/core.py): work reaching a busy decode worker joins its batch at
the next step boundary (a hand-off, a live migration), grouping steps into events changes no result, and the
views the policies get count requests placed on a decode worker that have not arrived yet, as the router's do."""
from __future__ import annotations

import dataclasses

import pytest

from simulator import elastic as sim_elastic
from services.router.policy.profiles import Profile
from simulator.elastic import Elastic
from simulator.core import Simulation
from simulator.state import SimRequest, SimWorker
from simulator.tier import SimTier
from simulator.simulate import MigrationConfig, TraceRequest, _make_policy, simulate
from simulator.workloads import shifting_workload

BS = 16
STEP = 0.05  # every decode step of HAND, whatever the batch
# prefill of c tokens: 0.1 + 1e-3 * c s; a block (16 tokens) moves between workers in 0.02 s
HAND = Profile("hand", prefill_a=0.0, prefill_b=1e-3, prefill_c=0.1, decode_base_s=STEP, decode_per_seq_s=0.0,
               decode_per_kv_token_s=0.0, kv_bytes_per_token=1_250_000, transfer_gbps=1.0, chunk_tokens=1000,
               tier_dram_gbps=1.0, tier_ssd_gbps=1.0)
TICK_ONLY = MigrationConfig(kv_high=float("inf"), skew_min=0)  # ticks run, nothing moves unless a worker drains


def _req(idx: int, t: float, tokens: int, out: int) -> TraceRequest:
    return TraceRequest(idx, t, tokens, out, tuple(range(1000 * idx, 1000 * idx + -(-tokens // BS))))


def test_handoff_after_the_last_arrival_joins_at_the_next_step():
    """A: prefill 0 -> 0.18, 5 blocks handed off in 0.1 s, first token 0.28, then 99 steps to 5.23. B, the last
    arrival (0.31): prefill to 0.49, first token at 0.59, while the decode worker runs A's steps (boundaries
    0.28 + 0.05 j, planned at 0.33 with nothing known to bound them). B joins at 0.63: tokens at 0.68 and 0.73
    (before the fix it waited for A's last step, 5.23: TPOT 2.37 s)."""
    tr = [_req(0, 0.0, 80, 100), _req(1, 0.31, 80, 3)]
    res = simulate(tr, "round_robin", HAND, num_workers=1, prefill_workers=1, kv_capacity_blocks=1000,
                   block_size=BS, ttft_slo_s=None, tpot_slo_s=None)
    assert res["_ttfts"] == pytest.approx([0.28, 0.59 - 0.31])  # B ends first
    assert res["_tpots"] == pytest.approx([(0.73 - 0.59) / 2, STEP])
    assert res["makespan_s"] == pytest.approx(5.23)


def _skewed() -> list[TraceRequest]:
    """Round robin over 2 decode workers: the even requests (long outputs) land on w001, the odd ones (short) on
    w002, which soon idles: the skew rule moves w001's streams over, one or two per tick, while more arrive."""
    return [_req(i, 0.4 * i, 80 + 16 * (i % 3), 300 if i % 2 == 0 else 4) for i in range(24)]


def _join_waits(monkeypatch, trace, **kw) -> tuple[dict, list[tuple[str, float]]]:
    """Run ``simulate`` recording, for each stream that reaches a decode worker (hand-off or migration), the wait
    from its arrival to the start of the first step that decodes it there."""
    arrived: dict[int, tuple[int, float, str]] = {}
    waits: list[tuple[str, float]] = []
    handoff, arrive, step_done = Simulation.handoff, Elastic.arrive, Simulation.step_done

    def on_handoff(self, r):
        arrived[r.tr.idx] = (r.decode_w, self.now, "handoff")
        handoff(self, r)

    def on_arrive(self, r, source):
        arrive(self, r, source)
        arrived[r.tr.idx] = (r.decode_w, self.sim.now, "migration")

    def on_step_done(self, widx, gen, k, chunks, decoding):
        for r in decoding:
            if r.tr.idx in arrived:
                w, t, how = arrived.pop(r.tr.idx)
                assert w == widx
                waits.append((how, self.now - k * STEP - t))  # this event's first step started at now - k STEP
        step_done(self, widx, gen, k, chunks, decoding)

    monkeypatch.setattr(Simulation, "handoff", on_handoff)
    monkeypatch.setattr(Elastic, "arrive", on_arrive)
    monkeypatch.setattr(Simulation, "step_done", on_step_done)
    res = simulate(trace, "round_robin", HAND, num_workers=2, prefill_workers=1, kv_capacity_blocks=10_000,
                   block_size=BS, **kw)
    return res, waits


def test_streams_join_a_busy_batch_at_the_next_step_boundary(monkeypatch):
    res, waits = _join_waits(monkeypatch, _skewed(), migration=MigrationConfig(min_tokens_left=1))
    assert res["served"] == 24 and res["migrations"]["by_reason"]["skew"] >= 4
    kinds = {how for how, _ in waits}
    assert kinds == {"handoff", "migration"}
    # it waits for the step under way (a whole one when it lands on a boundary: the step ends first), never more
    assert all(-1e-9 <= wait <= STEP + 1e-9 for _, wait in waits), waits
    assert max(wait for _, wait in waits) > 0  # some did arrive mid-step


@pytest.mark.parametrize("make", [_skewed, lambda: shifting_workload(chat_s=20, agent_s=20, chat_rps=8)])
def test_ticks_that_decide_nothing_change_nothing(make):
    """A step event's boundaries do not depend on how steps are grouped: ticks (which bound multi-steps) with no
    move to make give the plain simulator's result exactly."""
    trace = make()
    kw = dict(num_workers=2, prefill_workers=1, ttft_slo_s=2.0, tpot_slo_s=0.05)
    if make is _skewed:
        kw.update(profile=HAND, kv_capacity_blocks=10_000, block_size=BS)
    plain = simulate(trace, "kv_cost", **kw)
    ticked = simulate(trace, "kv_cost", migration=TICK_ONLY, tick_s=0.7, **kw)
    assert ticked["migrations"]["ordered"] == 0
    for key in ("migrations", "tick_s", "startup_s"):
        ticked.pop(key)
    assert ticked == plain


def _sim(policy: str = "least_loaded") -> Simulation:
    return Simulation([], _make_policy(policy, 0), HAND, 2, 1, 1000, None, SimTier(0, 0, None, 1.0, 1.0), "chat", BS)


def test_decode_view_counts_placements_under_way():
    """Placed on a decode worker, prefill under way on the prefill worker: the next placement sees it waiting
    there (as the router's view adds its own in-flight placements) and a load-aware policy goes elsewhere."""
    a, b = _req(0, 0.0, 800, 10), _req(1, 0.001, 800, 10)
    sim = _sim()
    sim.trace = [a, b]
    sim.arrive(a)
    dec = {v.worker_id: v for v in sim.view(b).decode}
    placed_on = sim.workers[sim.workers[0].running[0].decode_w]
    assert (dec[placed_on.wid].num_running, dec[placed_on.wid].num_waiting) == (0, 1)
    assert sum(v.num_waiting for v in dec.values()) == 1
    res = simulate([a, b], "least_loaded", HAND, num_workers=2, prefill_workers=1, kv_capacity_blocks=1000,
                   block_size=BS)
    assert res["served"] == 2 and res["_tpots"] == pytest.approx([STEP, STEP])  # one stream per decode worker


def test_migration_and_planner_inputs_match_the_routers(monkeypatch):
    """``DecodeLoad.running`` = max(running + waiting, placed and not ended); ``PoolWorker.num_waiting`` =
    max(waiting, placed - running): requests on their way to a decode worker count in both (as in
    services/router/migration.py ``consider`` and services/router/planner.py ``pool``)."""
    sim = _sim()
    trace = [_req(i, 0.0, 800, 10) for i in range(3)]
    sim.trace = trace
    elastic = Elastic(sim, MigrationConfig(), None, 1.0, 0.0)
    for r in trace:
        sim.arrive(r)
    seen = {}
    monkeypatch.setattr(sim_elastic, "choose_moves", lambda cfg, now, loads, streams, inflight:
                        seen.update(loads={d.worker_id: d.running for d in loads}) or [])
    elastic.migrate()
    incoming = {w.wid: w.incoming for w in sim.workers if w.role == "decode"}
    assert sum(incoming.values()) == 3 and seen["loads"] == incoming
    pool = {w.wid: elastic.pool_worker(w) for w in sim.workers}
    assert all(pool[wid].num_waiting == n and pool[wid].num_running == 0 for wid, n in incoming.items())
    assert dataclasses.astuple(pool["w000"])[4:6] == (1, 2)  # prefill: one running, two queued


def test_kv_usage_is_what_a_heartbeat_reports():
    """The engine allocates a stream's blocks as its tokens come and never reports more than a full pool; the
    simulator reserves the output's blocks on arrival and lets reservations exceed the pool."""
    w = SimWorker(1, "decode", 10)
    r = SimRequest(_req(0, 0.0, 64, 64), 1, 64)  # 4 prompt blocks, 4 more for the output (BS 16)
    r.total_blocks = r.private = w.private = 8
    r.generated = 1
    w.running.append(r)
    assert w.used == 8 and w.kv_usage(BS) == pytest.approx(0.5)  # 65 tokens: 5 blocks written
    r.generated = 64
    assert w.kv_usage(BS) == pytest.approx(0.8)
    w.private += 30  # reservations beyond the pool (hand-offs are never refused)
    assert w.used == 38 and w.kv_usage(BS) == 1.0
