"""The online P:D planner: moves capacity between prefill and decode as the load shifts. Pure and
deterministic (no clock of its own, no I/O): the router runs it on heartbeats (``services/router/planner.py``),
the simulator on its simulated cluster, through the same object.

Pressure of a role (1.0 = at its SLO or full):

- **prefill**: the TTFT a new prompt would wait for, queued prompt tokens spread over the prefill workers
  (``cost.prefill_s(queued / n)``), over ``ttft_slo_s``;
- **decode**: the mean over decode workers of the largest of step time over ``tpot_slo_s`` (a decode step is
  one token for every stream), KV usage on its way to preemption (0 up to ``KV_CALM`` of the pool in use, 1 at
  ``KV_FULL``: a pool that is merely well used is not short), and batch occupancy ((running + waiting) /
  max_num_seqs).

Decisions, at most one per evaluation:

1. **switch**: one role at ``high`` or more while the other, having given up one worker, would stay under
   ``low`` — or under ``high`` while the short role's pressure is at least twice that: the least loaded
   switchable worker of the other role changes role (after a drain: its decode streams migrate away, its
   prefills finish; the model stays loaded).
2. **scale**: the same shortage but no worker can switch, or both roles short: the short role (the shorter
   one) grows by one if below its ``max_*``; a role under ``idle`` for the whole streak shrinks by one if
   above its ``min_*``. ``max_*`` 0: that role is not scaled. A scale decision counts as made until the
   reported workers show it, for at most ``scale_settle_s`` (workers take a while to start and heartbeat):
   bounds are checked against the reported workers plus the changes not yet shown, so a starting worker is
   never asked for twice, and one that has started is not counted twice.

Bounded flapping (the invariants the tests check): a decision needs ``sustain`` evaluations in a row that
propose it; two decisions are at least ``cooldown_s`` apart, or a third of it when the second moves capacity
the same way as the first (more of the same shortage: a reversal always waits the whole cooldown); a worker that
switched keeps its new role for ``dwell_s``; a role never drops below ``min_*`` workers; ``high`` > ``low`` leaves
a band where nothing moves.
"""
from __future__ import annotations

import dataclasses
from collections import deque

from services.router.policy.types import CostModel

KV_CALM, KV_FULL = 0.5, 0.95  # decode KV pressure: 0 up to KV_CALM of the pool in use, 1 at KV_FULL


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    high: float = 0.8   # a role at this pressure or above is short of capacity
    low: float = 0.5    # the donor role must stay below this after giving one worker
    idle: float = 0.05  # a role below this for a whole streak may shrink (scaling only)
    sustain: int = 3    # evaluations in a row proposing the same decision before it is made
    cooldown_s: float = 30.0  # between two decisions (a third of it between two toward the same role)
    dwell_s: float = 120.0    # a switched worker keeps its role at least this long
    min_prefill: int = 1
    min_decode: int = 1
    max_prefill: int = 0  # scale prefill up to this many workers (0 = never scale prefill)
    max_decode: int = 0
    scale_settle_s: float = 120.0  # a scale decision counts until then (its workers start and heartbeat)

    def __post_init__(self) -> None:
        if not (0 <= self.idle < self.low < self.high) or self.sustain < 1 or self.cooldown_s < 0 \
                or self.dwell_s < 0 or self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0 \
                or min(self.min_prefill, self.min_decode, self.max_prefill, self.max_decode) < 0:
            raise ValueError(f"invalid planner config {self}")


@dataclasses.dataclass(frozen=True)
class PoolWorker:
    """One prefill or decode worker as the planner sees it (from its heartbeat)."""
    worker_id: str
    role: str  # "prefill" | "decode"
    switchable: bool = False
    queued_prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    step_s: float = 0.0  # recent engine step time; on a decode worker, seconds per output token
    max_num_seqs: int = 0
    draining: bool = False


@dataclasses.dataclass(frozen=True)
class PlanAction:
    """``switch``: ``worker_id`` takes role ``role``; ``scale``: role ``role`` changes by ``delta`` workers.
    The pressures are those the decision was made on."""
    kind: str
    role: str
    reason: str
    worker_id: str = ""
    delta: int = 0
    prefill_pressure: float = 0.0
    decode_pressure: float = 0.0
    at: float = 0.0


def pressures(cfg: PlannerConfig, cost: CostModel, workers: list[PoolWorker]) -> tuple[float, float]:
    """(prefill pressure, decode pressure) of the workers that take work (see the module docstring)."""
    pre = [w for w in workers if w.role == "prefill" and not w.draining]
    dec = [w for w in workers if w.role == "decode" and not w.draining]
    queued = sum(w.queued_prefill_tokens for w in workers if w.role == "prefill")  # a draining one's too
    p = cost.prefill_s(queued / len(pre)) / cfg.ttft_slo_s if pre else (float("inf") if queued else 0.0)
    d = sum(max(w.step_s / cfg.tpot_slo_s, max(0.0, w.kv_usage - KV_CALM) / (KV_FULL - KV_CALM),
                (w.num_running + w.num_waiting) / max(1, w.max_num_seqs)) for w in dec) / len(dec) if dec else 0.0
    return p, d


class Planner:
    """The planner's state between evaluations: the current streak, the last decision, when each worker last
    switched, and the recent decisions (``history``, newest last) with counts by ``(kind, role, reason)``."""

    def __init__(self, cfg: PlannerConfig, cost: CostModel, history: int = 32) -> None:
        self.cfg, self.cost = cfg, cost
        self._streak: tuple[str, int] = ("", 0)  # proposed decision key, evaluations in a row
        self._last_at = float("-inf")
        self._last_toward = ""  # the role the last decision gave capacity to ("" for a scale-down)
        self.switched_at: dict[str, float] = {}
        self.history: deque[PlanAction] = deque(maxlen=history)
        # scale decisions not yet seen in the reported counts (and younger than scale_settle_s), with the count
        # of their role each one aims at
        self._settling: list[tuple[PlanAction, int]] = []
        self._planned: dict[str, int] = {}
        self.counts: dict[tuple[str, str, str], int] = {}
        self.last_pressures = (0.0, 0.0)

    def decide(self, now: float, workers: list[PoolWorker]) -> list[PlanAction]:
        """The decision to carry out now ([] or one action), from every prefill and decode worker alive."""
        cfg = self.cfg
        p, d = self.last_pressures = pressures(cfg, self.cost, workers)
        proposal = self._propose(now, workers, p, d)
        key = "" if proposal is None else f"{proposal.kind}:{proposal.role}:{proposal.delta}"
        self._streak = (key, self._streak[1] + 1 if key and key == self._streak[0] else int(bool(key)))
        toward = proposal.role if proposal is not None and proposal.delta >= 0 else ""
        cooldown = cfg.cooldown_s / 3 if toward and toward == self._last_toward else cfg.cooldown_s
        if proposal is None or self._streak[1] < cfg.sustain or now - self._last_at < cooldown:
            return []
        action = dataclasses.replace(proposal, prefill_pressure=round(p, 4), decode_pressure=round(d, 4), at=now)
        self._last_at, self._streak, self._last_toward = now, ("", 0), toward
        if action.kind == "switch":
            self.switched_at[action.worker_id] = now
        else:
            self._settling.append((action, self._planned[action.role] + action.delta))
        self.history.append(action)
        k = (action.kind, action.role, action.reason)
        self.counts[k] = self.counts.get(k, 0) + 1
        return [action]

    def _propose(self, now: float, workers: list[PoolWorker], p: float, d: float) -> PlanAction | None:
        cfg = self.cfg
        taking = [w for w in workers if not w.draining]
        count = {r: sum(w.role == r for w in taking) for r in ("prefill", "decode")}
        self._settling = [(a, target) for a, target in self._settling if now - a.at < cfg.scale_settle_s
                          and (count[a.role] < target if a.delta > 0 else count[a.role] > target)]
        planned = self._planned = {r: count[r] + sum(a.delta for a, _ in self._settling if a.role == r)
                                   for r in count}
        short = [r for r, x in (("prefill", p), ("decode", d)) if x >= cfg.high]
        if len(short) == 1:
            needy = short[0]
            donor = "decode" if needy == "prefill" else "prefill"
            n = count[donor]
            floor = cfg.min_decode if donor == "decode" else cfg.min_prefill
            after = (d if donor == "decode" else p) * n / (n - 1) if n > 1 else float("inf")
            short_by = p if needy == "prefill" else d
            if n > floor and (after < cfg.low or (after < cfg.high and short_by >= 2 * after)):
                pick = self._switch_candidate(now, taking, donor)
                if pick is not None:
                    return PlanAction("switch", needy, f"{needy}_pressure", worker_id=pick)
        if short:
            needy = max(short, key=lambda r: (p if r == "prefill" else d, r))
            cap = cfg.max_prefill if needy == "prefill" else cfg.max_decode
            if planned[needy] < cap:
                return PlanAction("scale", needy, f"{needy}_pressure", delta=1)
            return None
        for role, x in (("decode", d), ("prefill", p)):
            cap, floor = (cfg.max_decode, cfg.min_decode) if role == "decode" else (cfg.max_prefill, cfg.min_prefill)
            if cap and x < cfg.idle and min(count[role], planned[role]) > floor:
                return PlanAction("scale", role, f"{role}_idle", delta=-1)
        return None

    def _switch_candidate(self, now: float, workers: list[PoolWorker], role: str) -> str | None:
        fits = [w for w in workers if w.role == role and w.switchable
                and now - self.switched_at.get(w.worker_id, float("-inf")) >= self.cfg.dwell_s]
        if not fits:
            return None
        return min(fits, key=lambda w: (w.num_running + w.num_waiting, w.queued_prefill_tokens, w.worker_id)).worker_id

    def stats(self) -> dict:
        """What ``deepinfer status`` and ``/metrics`` show: pressures, decision counts, recent decisions."""
        return {"prefill_pressure": round(self.last_pressures[0], 4),
                "decode_pressure": round(self.last_pressures[1], 4),
                "decisions": {f"{k}:{r}:{why}": n for (k, r, why), n in sorted(self.counts.items())},
                "recent": [dataclasses.asdict(a) for a in self.history]}
