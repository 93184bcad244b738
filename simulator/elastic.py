"""The simulator's elastic cluster: live migration (``migration_policy.choose_moves``) and the online P:D planner
(``pd_planner.Planner``), run on a periodic tick with the SAME objects the router builds from heartbeats.

Every ``tick_s`` simulated seconds while work remains: the planner decides on ``PoolWorker``s of the live
workers, then the migration policy on ``DecodeLoad``/``MovableStream``s of the decode workers, built as the
router builds them (``services/router/planner.py`` ``pool``, ``services/router/migration.py`` ``consider``):
``DecodeLoad.running`` = max(running + waiting, placed and not ended), ``PoolWorker.num_waiting`` =
max(waiting, placed - running), where placed counts requests on their way (``incoming``); KV usage is what an
engine's heartbeat reports (blocks in use, at most 1), not the simulator's up-front reservations.

- A move reserves the stream's blocks on the target (no room: it does not move), detaches the stream from the
  source when the source's current step ends (freeing its blocks there) and resumes it on the target after
  the transfer of its context blocks (``block_s`` each): that transfer is the stream's pause.
- ``switch``: the worker drains (no new placements; a decode worker's streams migrate by the drain rule when
  migration is on, else they finish there), then takes its new role once it holds nothing.
- ``scale`` +1: a new worker of the role joins after ``startup_s`` (model loading; paid for from the decision);
  -1: the least loaded worker of the role drains, then leaves.

Invariants: a stream is in exactly one worker's ``running`` or in transit, so every request is served once;
``in_flight[source]`` counts moves ordered out of ``source`` and not yet arrived; a draining worker retires
only when it holds nothing (no running, queued, incoming or departing request).
"""
from __future__ import annotations

import logging

from services.router.policy.migration_policy import DecodeLoad, MigrationConfig, MovableStream, choose_moves
from services.router.policy.pd_planner import Planner, PlannerConfig, PoolWorker
from simulator.core import MOVED, START, TICK, Simulation
from simulator.state import SimRequest, SimWorker

logger = logging.getLogger(__name__)


class Elastic:
    def __init__(self, sim: Simulation, migration: MigrationConfig | None, planner: PlannerConfig | None,
                 tick_s: float, startup_s: float) -> None:
        if tick_s <= 0 or startup_s < 0:
            raise ValueError(f"tick_s must be > 0 and startup_s >= 0, got {tick_s}, {startup_s}")
        self.sim, self.migration, self.tick_s, self.startup_s = sim, migration, tick_s, startup_s
        self.planner = Planner(planner, sim.cost) if planner is not None else None
        self.in_flight: dict[str, int] = {}
        self.moves = self.ordered = self.cancelled = self.no_room = 0
        self.by_reason: dict[str, int] = {}
        self.pause_s = 0.0
        self.decisions: list[dict] = []
        self.resized = False  # a worker joined or left: GPU time is summed per worker
        sim.elastic = self

    # --- the tick ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.sim.trace:
            self._schedule(self.sim.trace[0].arrival_s + self.tick_s)

    def _schedule(self, t: float) -> None:
        self.sim.next_tick = t
        self.sim.push(t, TICK, None)

    def on_event(self, kind: int, data) -> None:
        if kind == TICK:
            self.tick()
        elif kind == MOVED:
            self.arrive(*data)
        elif kind == START:
            self.join(*data)

    def tick(self) -> None:
        sim = self.sim
        if self.planner is not None:
            for action in self.planner.decide(sim.now, [self.pool_worker(w) for w in self.live()]):
                self.carry_out(action)
        if self.migration is not None:
            self.migrate()
        for w in self.live():
            if w.draining:
                self.maybe_retire(w)
        if any(kind not in (TICK, START) and not sim.stale(kind, d) for _, kind, _, d in sim.events):  # work remains
            self._schedule(sim.now + self.tick_s)
        else:
            sim.next_tick = float("inf")

    def live(self) -> list[SimWorker]:
        return [w for w in self.sim.workers if not w.removed]

    # --- live migration ----------------------------------------------------------------------------------
    def _step_s(self, w: SimWorker) -> float:
        """Seconds per output token of the worker's decoding streams (0 when none decodes)."""
        return self.sim.p.decode_step_s(sum(r.first_s is not None for r in w.running), w.kv_tokens)

    def migrate(self) -> None:
        sim = self.sim
        decode = [w for w in self.live() if w.role == "decode"]
        # as the router: running is the larger of running + waiting and what was placed there (not ended)
        loads = [DecodeLoad(w.wid, max(len(w.running) + len(w.queue), w.num_placed), w.kv_usage(sim.bs),
                            w.draining, step_s=self._step_s(w)) for w in decode]
        streams, by_rid = [], {}
        for w in decode:
            for r in w.running:
                if r.first_s is None or r.generated >= r.tr.output_length:
                    continue  # still prefilling here (a local prefill)
                rid = f"r{r.tr.idx}"
                by_rid[rid] = (r, w)
                streams.append(MovableStream(rid, w.wid, r.tr.input_length + r.generated,
                                             r.tr.output_length - r.generated, r.moved_at, r.move_to is not None,
                                             r.priority))
        for rid, target, reason in choose_moves(self.migration, sim.now, loads, streams, self.in_flight):
            r, source = by_rid[rid]
            self.order(r, source, sim.by_id[target], reason)

    def order(self, r: SimRequest, source: SimWorker, target: SimWorker, reason: str) -> None:
        """Reserve ``r``'s blocks on ``target`` and mark it to leave ``source`` between steps."""
        need = -(-(r.tr.input_length + r.tr.output_length) // self.sim.bs)
        if target.cap - target.used < need:
            self.no_room += 1
            return
        target.private += need
        target.evict()
        target.incoming += 1
        r.move_to = (target.idx, reason)
        source.moves_out.append(r)
        self.in_flight[source.wid] = self.in_flight.get(source.wid, 0) + 1
        self.ordered += 1
        if not source.busy:  # between steps already
            self.detach(source)

    def detach(self, w: SimWorker) -> None:
        """The streams ordered out of ``w`` leave it now; one that finished meanwhile frees its reservation."""
        sim = self.sim
        for r in w.moves_out:
            tidx, reason = r.move_to
            if r not in w.running:  # it finished on the source: nothing to move
                target = sim.workers[tidx]
                target.private -= -(-(r.tr.input_length + r.tr.output_length) // sim.bs)
                target.incoming -= 1
                r.move_to = None
                self.in_flight[w.wid] -= 1
                self.cancelled += 1
                continue
            w.running.remove(r)
            w.release(r)
            w.kv_tokens -= r.tr.input_length + r.generated
            t = sim.now + -(-(r.tr.input_length + r.generated) // sim.bs) * sim.block_s
            self.pause_s += t - sim.now
            sim.push(t, MOVED, (r, w.wid))
        w.moves_out = []

    def arrive(self, r: SimRequest, source: str) -> None:
        """``r``'s context arrived on its target: it decodes there from the next step."""
        sim = self.sim
        tidx, reason = r.move_to
        w = sim.workers[tidx]
        w.incoming -= 1
        r.private = -(-(r.tr.input_length + r.tr.output_length) // sim.bs)  # reserved by order()
        r.decode_w, r.move_to, r.moved_at = tidx, None, sim.now
        w.running.append(r)
        w.kv_tokens += r.tr.input_length + r.generated
        self.in_flight[source] -= 1
        self.moves += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        sim.join(w)  # it joins the batch at the target's next step boundary

    # --- the P:D planner ---------------------------------------------------------------------------------
    def pool_worker(self, w: SimWorker) -> PoolWorker:
        """As the router's planner builds it: waiting is ``max(waiting, placed - running)`` (placed: requests
        placed there and not ended, including those on their way); KV usage as the engine reports it."""
        return PoolWorker(w.wid, w.role, switchable=True, queued_prefill_tokens=w.queued_tokens + w.prefill_left,
                          num_running=len(w.running), num_waiting=w.num_waiting,
                          kv_usage=w.kv_usage(self.sim.bs), step_s=self._step_s(w),
                          max_num_seqs=self.sim.p.max_num_seqs, draining=w.draining)

    def carry_out(self, action) -> None:
        sim = self.sim
        start = sim.trace[0].arrival_s
        rec = {"t_s": round(sim.now - start, 6), "kind": action.kind, "role": action.role, "reason": action.reason,
               "worker": action.worker_id, "delta": action.delta, "prefill_pressure": action.prefill_pressure,
               "decode_pressure": action.decode_pressure, "done_s": None}
        self.decisions.append(rec)
        logger.debug("planner at %.1f s: %s", sim.now - start, rec)
        if action.kind == "switch":
            self.drain(sim.by_id[action.worker_id], rec)
        elif action.delta > 0:
            sim.push(sim.now + self.startup_s, START, (action.role, sim.now, rec))
        elif action.delta < 0:
            pick = min((w for w in self.live() if w.role == action.role and not w.draining),
                       key=lambda w: (len(w.running) + len(w.queue), w.queued_tokens, w.wid), default=None)
            if pick is None:
                logger.warning("planner asked to shrink %s, which has no worker taking work", action.role)
                return
            rec["worker"] = pick.wid
            self.drain(pick, rec)

    def drain(self, w: SimWorker, rec: dict) -> None:
        if w.draining or w.removed:
            logger.warning("planner decision on %s ignored: it is draining or gone already", w.wid)
            return
        w.draining, w.after_drain = True, rec
        self.maybe_retire(w)

    def maybe_retire(self, w: SimWorker) -> None:
        """A draining worker holding nothing takes its new role (switch) or leaves (scale -1)."""
        if not w.draining or not w.holds_nothing():
            return
        rec, now = w.after_drain, self.sim.now
        rec["done_s"] = round(now - self.sim.trace[0].arrival_s, 6)
        w.draining, w.after_drain = False, None
        if rec["kind"] == "switch":
            w.role = rec["role"]
            return
        w.removed, w.ended_s = True, now
        self.resized = True

    def join(self, role: str, decided_s: float, rec: dict) -> None:
        sim = self.sim
        w = SimWorker(len(sim.workers), role, sim.kv_capacity_blocks, born_s=decided_s)
        sim.workers.append(w)
        sim.by_id[w.wid] = w
        rec["worker"], rec["done_s"] = w.wid, round(sim.now - sim.trace[0].arrival_s, 6)
        self.resized = True

    # --- results -----------------------------------------------------------------------------------------
    def worker_seconds(self, stop: float) -> float:
        """Seconds of worker time paid for until ``stop`` (a worker being started counts from its decision)."""
        paid = sum(min(stop, w.ended_s if w.ended_s is not None else stop) - w.born_s for w in self.sim.workers)
        return paid + sum(max(0.0, stop - d[1]) for t, kind, _, d in self.sim.events if kind == START)

    def results(self) -> dict:
        out: dict = {}
        if self.migration is not None:
            out["migrations"] = {"moves": self.moves, "by_reason": dict(sorted(self.by_reason.items())),
                                 "pause_s_total": round(self.pause_s, 6), "ordered": self.ordered,
                                 "cancelled": self.cancelled, "no_room": self.no_room}
        if self.planner is not None:
            live = self.live()
            out["planner"] = {"decisions": self.decisions, "counts": self.planner.stats()["decisions"],
                              "final_prefill": sum(w.role == "prefill" for w in live),
                              "final_decode": sum(w.role == "decode" for w in live)}
        return out
