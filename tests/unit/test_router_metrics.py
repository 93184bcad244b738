"""RouterMetrics: every method's effect on the rendered scrape, parsed back with prometheus_client's parser."""
import pytest

from prometheus_client import CollectorRegistry

from services.router.metrics import RouterMetrics
from services.router.workers import WorkerTable
from tests.unit.test_metrics import parse, value
from tests.unit.test_router_state import report


def scrape(metrics: RouterMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return parse(body)


def test_requests_latencies_and_tokens():
    m = RouterMetrics()
    for _ in range(3):
        m.request_started("nats")
    m.request_started("http")
    m.request_finished("nats", "finished", ttft_s=0.2, tpot_s=0.05, e2e_s=1.0,
                       usage={"prompt_tokens": 40, "cached_tokens": 32, "tier_cached_tokens": 16,
                              "completion_tokens": 8, "ttft_ms": 200.0})
    m.request_finished("nats", "finished", ttft_s=0.4, tpot_s=None, e2e_s=0.4,
                       usage={"prompt_tokens": 10, "cached_tokens": 99, "completion_tokens": 1})
    m.request_finished("http", "timeout", ttft_s=None, usage=None)
    s = scrape(m)
    assert value(s, "deepinfer_router_inflight") == 1
    assert value(s, "deepinfer_router_requests_total", api="nats", outcome="finished") == 2
    assert value(s, "deepinfer_router_requests_total", api="http", outcome="timeout") == 1
    assert value(s, "deepinfer_router_ttft_seconds_count") == 2
    assert value(s, "deepinfer_router_ttft_seconds_sum") == pytest.approx(0.6)
    assert value(s, "deepinfer_router_ttft_seconds_bucket", le="0.25") == 1
    assert value(s, "deepinfer_router_tpot_seconds_count") == 1
    assert value(s, "deepinfer_router_e2e_seconds_sum") == pytest.approx(1.4)
    assert value(s, "deepinfer_router_prompt_tokens_total") == 50
    assert value(s, "deepinfer_router_cached_prompt_tokens_total") == 42       # 32 + min(99, 10)
    assert value(s, "deepinfer_router_tier_cached_prompt_tokens_total") == 16
    assert value(s, "deepinfer_router_completion_tokens_total") == 9


def test_labels_stay_bounded_and_odd_input_never_raises():
    m = RouterMetrics()
    m.request_finished("grpc", "made-up-outcome", ttft_s=-1.0, usage={"prompt_tokens": "x", "cached_tokens": None})
    for i in range(20):
        m.rejected(f"reason-{i}")
    m.rejected("overloaded")
    s = scrape(m)
    assert value(s, "deepinfer_router_inflight") == 0                       # a finish without a start
    assert value(s, "deepinfer_router_requests_total", api="other", outcome="other") == 1
    assert value(s, "deepinfer_router_ttft_seconds_count") == 0
    assert value(s, "deepinfer_router_prompt_tokens_total") == 0
    reasons = {dict(lb)["reason"] for n, lb in s if n == "deepinfer_router_rejected_total"}
    assert len(reasons) == 17 and "other" in reasons and "overloaded" not in reasons   # 16 first + other
    assert value(s, "deepinfer_router_rejected_total", reason="other") == 5


def test_failovers_and_rejections():
    m = RouterMetrics()
    m.failover()
    m.failover()
    m.rejected("ttft_slo")
    s = scrape(m)
    assert value(s, "deepinfer_router_failovers_total") == 2
    assert value(s, "deepinfer_router_rejected_total", reason="ttft_slo") == 1


def test_worker_gauges_by_role_and_state_from_the_table():
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("p0", role="prefill"), now=0.0)
    table.update(report("d0"), now=0.0)
    table.update(report("d1", draining=True), now=0.0)
    table.update(report("d2"), now=-10.0)                  # silent: dead, not yet forgotten
    m = RouterMetrics(registry=CollectorRegistry())       # a registry passed in
    m.set_workers(table, now=1.0)
    s = scrape(m)
    assert value(s, "deepinfer_router_workers", role="prefill", state="alive") == 1
    assert value(s, "deepinfer_router_workers", role="decode", state="alive") == 1
    assert value(s, "deepinfer_router_workers", role="decode", state="draining") == 1
    assert value(s, "deepinfer_router_workers", role="decode", state="dead") == 1
    del table.workers["d2"], table.workers["d1"]
    m.set_workers(table, now=1.0)
    s = scrape(m)
    assert value(s, "deepinfer_router_workers", role="decode", state="dead") == 0  # seen before: now 0
    assert value(s, "deepinfer_router_workers", role="decode", state="draining") == 0


def test_render_refreshes_workers_from_a_watched_table_and_negotiates_openmetrics():
    table = WorkerTable(dead_after_s=3.0)
    table.update(report("d0"))
    m = RouterMetrics(table=table)
    assert value(scrape(m), "deepinfer_router_workers", role="decode", state="alive") == 1
    body, content_type = m.render(accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_two_instances_in_one_process_do_not_collide():
    a, b = RouterMetrics(), RouterMetrics()
    a.failover()
    assert value(scrape(a), "deepinfer_router_failovers_total") == 1
    assert value(scrape(b), "deepinfer_router_failovers_total") == 0
