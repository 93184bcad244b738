"""What a router reports on ``stats(<router>)`` (``deepinfer status``): its accounting ledger, workers as its
heartbeat table sees them, migrations and the P:D planner's decisions."""
from __future__ import annotations

from typing import Any


def router_stats(router: Any) -> dict:
    """``router``: a ``RouterService`` (duck-typed: ``ledger``, ``table``, ``relays``, ``migrator``, ``planner``)."""
    table = router.table
    return {"accounting": router.ledger.as_dict(), "in_flight": len(router.relays), "policy": router.config.policy,
            "workers": {wid: {"role": s.report.role, "alive": table.is_alive(wid), "draining": s.report.draining,
                              "model_fingerprint": s.report.model_fingerprint, "switchable": s.report.switchable,
                              "step_ms": round(s.report.step_ms, 3)}
                        for wid, s in table.workers.items()},
            "serving_fingerprint": router.placer.model.fingerprint, "errors": dict(router.runtime.error_counts),
            "migrations": {"done": router.migrator.done, "failed": router.migrator.failed,
                           "started_by_policy": dict(router.migrator.reasons)},
            "planner": router.planner.stats() if router.planner else None}
