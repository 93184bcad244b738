"""The router's P:D planner weighs the SLO classes in flight (``services/router/planner.RouterPlanner.weighed``):
its TTFT and TPOT targets tighten to the most demanding live class's, so the same pool is under more pressure
while interactive streams run than while batch streams alone do; the configured targets otherwise."""
from prometheus_client import CollectorRegistry

from services.router.planner import RouterPlanner
from services.router.policy.pd_planner import Planner, PlannerConfig, PoolWorker, pressures
from services.router.policy.types import CostModel
from services.router.workers import WorkerTable


def test_the_tightest_live_class_sets_the_planners_targets():
    cost = CostModel(prefill_b=1e-3)
    planner = RouterPlanner(None, WorkerTable(3.0), Planner(PlannerConfig(ttft_slo_s=2.0, tpot_slo_s=0.1), cost),
                            "router", CollectorRegistry())
    pool = [PoolWorker("p0", "prefill", queued_prefill_tokens=1000), PoolWorker("d0", "decode", step_s=0.06)]
    live = {"targets": (0.0, 0.0)}
    planner.targets = lambda: live["targets"]
    planner.step(now=0.0)
    assert (planner.planner.cfg.ttft_slo_s, planner.planner.cfg.tpot_slo_s) == (2.0, 0.1)   # batch alone
    calm = pressures(planner.planner.cfg, cost, pool)
    live["targets"] = (1.0, 0.05)   # an interactive stream is in flight
    planner.step(now=1.0)
    assert (planner.planner.cfg.ttft_slo_s, planner.planner.cfg.tpot_slo_s) == (1.0, 0.05)
    assert pressures(planner.planner.cfg, cost, pool) == (calm[0] * 2, calm[1] * 2)
    live["targets"] = (5.0, 0.0)    # looser than configured, or none: the configured ones stand
    assert (planner.weighed().ttft_slo_s, planner.weighed().tpot_slo_s) == (2.0, 0.1)


def test_the_router_reports_the_tightest_targets_of_the_classes_it_relays():
    from types import SimpleNamespace

    from services.router.config import RouterConfig
    from services.router.service import RouterService

    router = RouterService(RouterConfig())
    assert router.live_class_targets() == (0.0, 0.0)   # nothing relayed
    live = lambda *classes: {str(i): SimpleNamespace(slo_class=c) for i, c in enumerate(classes)}   # noqa: E731
    router.relay = SimpleNamespace(live=live("batch", "standard"))
    assert router.live_class_targets() == (0.0, 0.0)   # no targets among them
    router.relay = SimpleNamespace(live=live("batch", "interactive"))
    assert router.live_class_targets() == (1.0, 0.05)
