"""The online P:D planner, router side: every ``interval_s`` it feeds the prefill and decode heartbeats to the
planner policy (``services/router/policy/pd_planner.Planner``, the one the simulator runs) and carries out its decisions.

- ``switch``: ``RoleSwitch`` on ``ctl(<worker>, "role")`` to a switchable worker (``services/switchable``); the
  worker drains (its decode streams live-migrate away: the router's ``Migrator`` moves a draining worker's
  streams) and answers once it serves the new role; the heartbeats then show it in its new role.
- ``scale``: the ``Scaler`` (``services/router/scaler.py``: the Kubernetes scale subresource of the role's
  Deployment, or ``deepinfer up``'s launcher) changes the role's worker count.

Invariants: one planner per cluster decides: the router whose id sorts first among the live routers (the others'
planners watch but do not act, so two routers never double a decision); at most one decision is carried out at
a time (a new one waits for the last to end); every wait is bounded (``switch_timeout_s``, the scaler's own
timeout); a failed decision is logged and counted, never retried blindly (the policy decides again after its
cooldown; a failed scale-up counts as settling until it shows or its time runs out); nothing is decided once the
router drains (``close``). Decisions, their reasons and the pressures are on ``/metrics``
(``deepinfer_router_planner_*``) and in ``deepinfer status`` (``stats``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode
from services.router.policy.pd_planner import PlanAction, Planner, PlannerConfig, PoolWorker
from services.router.policy.types import CostModel
from services.router.workers import WorkerTable

logger = logging.getLogger(__name__)
P = "deepinfer_router_planner"


class RouterPlanner:
    def __init__(self, nc, table: WorkerTable, planner: Planner, router_id: str, registry: CollectorRegistry,
                 interval_s: float = 1.0, switch_timeout_s: float = 90.0, scaler=None,
                 spawn: Callable = asyncio.ensure_future) -> None:
        self.nc, self.table, self.planner, self.router_id = nc, table, planner, router_id
        self.interval_s, self.switch_timeout_s, self.scaler, self.spawn = interval_s, switch_timeout_s, scaler, spawn
        self.busy = False  # a decision is being carried out
        self.closed = False
        self.base = planner.cfg   # the configured targets; ``targets`` tightens them per evaluation
        self.targets: Callable[[], tuple[float, float]] | None = None   # the live classes' tightest TTFT, TPOT
        self.failed = 0
        self._decisions = Counter(f"{P}_decisions", "P:D planner decisions made, by kind, role and reason",
                                  ["kind", "role", "reason"], registry=registry)
        self._failed = Counter(f"{P}_failed", "P:D planner decisions that could not be carried out", ["kind"],
                               registry=registry)
        self._pressure = Gauge(f"{P}_pressure", "Pressure of a role as the planner sees it (1 = at its SLO / "
                               "full)", ["role"], registry=registry)
        self._leader = Gauge(f"{P}_leader", "1 on the router whose planner acts", registry=registry)

    @classmethod
    def for_router(cls, nc, table: WorkerTable, config, cost: CostModel, registry: CollectorRegistry,
                   spawn: Callable) -> "RouterPlanner | None":
        """The router's planner from ``RouterConfig`` (``planner`` off: None)."""
        if not config.planner:
            return None
        cfg = PlannerConfig(ttft_slo_s=config.planner_ttft_slo_s, tpot_slo_s=config.planner_tpot_slo_s,
                            sustain=config.planner_sustain, cooldown_s=config.planner_cooldown_s,
                            dwell_s=config.planner_dwell_s, max_prefill=config.planner_max_prefill,
                            max_decode=config.planner_max_decode)
        from services.router.scaler import make_scaler
        scaled = {r: (lo, hi) for r, lo, hi in (("prefill", cfg.min_prefill, cfg.max_prefill),
                                                 ("decode", cfg.min_decode, cfg.max_decode)) if hi > 0}
        scaler = make_scaler(config.planner_scaler, min_replicas={r: lo for r, (lo, _) in scaled.items()},
                             max_replicas={r: hi for r, (_, hi) in scaled.items()}, nc=nc)
        return cls(nc, table, Planner(cfg, cost), config.worker_id, registry, config.planner_interval_s,
                   max(90.0, config.drain_grace_s * 2 + 30.0), scaler, spawn)

    def pool(self, now: float) -> list[PoolWorker]:
        """Every live prefill and decode worker, as the policy sees it."""
        out = []
        for s in self.table.workers.values():
            r = s.report
            if r.role in ("prefill", "decode") and self.table.is_alive(r.worker_id, now):
                # what the router placed there (not ended / not prefilled) includes what the heartbeat reports
                out.append(PoolWorker(r.worker_id, r.role, r.switchable,
                                      max(r.queued_prefill_tokens, s.inflight_tokens), r.num_running,
                                      max(r.num_waiting, s.inflight - r.num_running), r.kv_usage,
                                      r.step_ms / 1000.0, r.max_num_seqs, r.draining))
        return out

    def leads(self, now: float) -> bool:
        """Whether this router's planner acts: its id sorts first among the live routers'."""
        routers = [s.report.worker_id for s in self.table.workers.values()
                   if s.report.role == "router" and self.table.is_alive(s.report.worker_id, now)]
        return all(self.router_id <= wid for wid in routers)

    def step(self, now: float | None = None) -> list[PlanAction]:
        """One evaluation; starts the decision's execution (returned) when this router leads and is not busy."""
        now = time.monotonic() if now is None else now
        lead = self.leads(now)
        self._leader.set(int(lead))
        if not lead or self.busy:
            return []
        self.planner.cfg = self.weighed()
        actions = self.planner.decide(now, self.pool(now))
        p, d = self.planner.last_pressures
        self._pressure.labels(role="prefill").set(min(p, 1e6))
        self._pressure.labels(role="decode").set(d)
        for action in actions:
            self._decisions.labels(kind=action.kind, role=action.role, reason=action.reason).inc()
            logger.info("planner: %s %s%s (%s; prefill pressure %.2f, decode %.2f)", action.kind, action.role,
                        f" on {action.worker_id}" if action.worker_id else f" by {action.delta:+d}", action.reason,
                        action.prefill_pressure, action.decode_pressure)
            self.busy = True
            self.spawn(self._carry_out(action))
        return actions

    def weighed(self) -> PlannerConfig:
        """The configured targets, tightened to the most demanding SLO class with a stream in flight (its TTFT
        and TPOT targets where it has them and they are tighter): a pool serving interactive streams is short of
        capacity sooner than one serving batch alone."""
        ttft, tpot = self.targets() if self.targets is not None else (0.0, 0.0)
        base = self.base
        return dataclasses.replace(base, ttft_slo_s=min(base.ttft_slo_s, ttft or base.ttft_slo_s),
                                   tpot_slo_s=min(base.tpot_slo_s, tpot or base.tpot_slo_s))

    async def run(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.interval_s)
            if self.closed:
                return
            try:
                self.step()
            except Exception:  # a bad heartbeat must not end the planner for good
                logger.exception("planner: evaluation failed")

    async def close(self) -> None:
        """Stop deciding (the router drains) and release the scaler."""
        self.closed = True
        if self.scaler is not None:
            await self.scaler.close()

    async def _carry_out(self, action: PlanAction) -> None:
        try:
            if action.kind == "switch":
                reply = await self.nc.request(subjects.ctl(action.worker_id, "role"),
                                              protocol.encode(protocol.RoleSwitch(role=action.role)),
                                              timeout=self.switch_timeout_s)
                protocol.decode_reply(reply.data, protocol.Ack)
            elif self.scaler is None:
                raise DeepinferError(ErrorCode.UNAVAILABLE, "no scaler is configured (--planner-scaler)")
            else:
                await self.scaler.scale(action.role, action.delta)
        except Exception as err:  # a timeout, no responders, the worker's or the API's refusal
            self.failed += 1
            self._failed.labels(kind=action.kind).inc()
            logger.warning("planner: %s %s not carried out: %r", action.kind, action.role, err)
        finally:
            self.busy = False

    def stats(self) -> dict:
        return {**self.planner.stats(), "failed": self.failed, "busy": self.busy,
                "leader": self.leads(time.monotonic())}
