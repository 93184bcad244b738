"""The router's Prometheus metrics (``deepinfer_router_*``), exposed on its HTTP ``GET /metrics``.

API (every method is O(1) except ``set_workers``, safe to call on the event loop, never raises on odd input):

- ``RouterMetrics(registry=None, table=None)``: owns a fresh registry unless one is passed; with ``table`` (the
  router's ``WorkerTable``) every ``render`` refreshes the worker gauges first.
- ``request_started(api)`` when a request is admitted for serving (``api``: ``"nats"`` or ``"http"``);
  ``inflight`` goes up by one.
- ``request_finished(api, outcome, ttft_s=None, tpot_s=None, e2e_s=None, usage=None)`` exactly once per
  ``request_started``: ``inflight`` goes down, ``requests_total{api,outcome}`` up. ``outcome``: ``"finished"``,
  ``"cancelled"`` or an ``ErrorCode`` value (others count as ``"other"``). Latencies in seconds, None = not
  known (e.g. no token before an error); ``usage`` is the final chunk's usage dict (``prompt_tokens``,
  ``cached_tokens``, ``tier_cached_tokens``, ``completion_tokens``; missing keys count 0).
- ``rejected(reason)`` for a request refused before serving (admission: ``"overloaded"``, ``"ttft_slo"``;
  HTTP: ``"unauthorized"``, …): ``rejected_total{reason}`` only — a rejected request was never started, so it
  is not in ``requests_total``. ``reason`` is free text bounded to 16 distinct values (then ``"other"``).
- ``failover()`` each time a stream is re-placed on another worker.
- ``set_workers(table, now=None)``: ``workers{role,state}`` from a ``WorkerTable`` (state ``alive``,
  ``draining``, ``dead``: silent past ``dead_after_s`` but not yet forgotten). Combinations seen before and
  absent now read 0.
- ``render(accept="") -> (body, content_type)``: the scrape (OpenMetrics when ``accept`` asks for it).

Invariants: ``inflight == started - finished`` (never negative); histograms only hold observed, non-negative
values; no request id or tenant is ever a label value (labels: api, outcome, reason, role, state).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.metrics.common import (E2E_BUCKETS, OTHER, TPOT_BUCKETS, TTFT_BUCKETS, BoundedLabel, new_registry,
                                   outcome_label, render)

P = "deepinfer_router"
APIS = frozenset({"nats", "http"})
WORKER_STATES = ("alive", "draining", "dead")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, table: Any = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self.table = table
        r = self.registry
        self._requests = Counter(f"{P}_requests", "Requests served, by API and outcome", ["api", "outcome"],
                                 registry=r)
        self.ttft = Histogram(f"{P}_ttft_seconds", "Arrival at the router to the first token relayed",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{P}_tpot_seconds", "Mean time per output token after the first, per request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{P}_e2e_seconds", "Arrival at the router to the final chunk", buckets=E2E_BUCKETS,
                             registry=r)
        self.inflight = Gauge(f"{P}_inflight", "Requests being served now", registry=r)
        self.failovers = Counter(f"{P}_failovers", "Streams re-placed on another worker", registry=r)
        self._rejected = Counter(f"{P}_rejected", "Requests refused before serving, by reason", ["reason"],
                                 registry=r)
        self._workers = Gauge(f"{P}_workers", "Workers in the router's table, by role and state",
                              ["role", "state"], registry=r)
        self.prompt_tokens = Counter(f"{P}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(f"{P}_cached_prompt_tokens", "Of the prompt tokens, those served from a "
                                     "cache (a worker's prefix cache or the cache tier)", registry=r)
        self.tier_tokens = Counter(f"{P}_tier_cached_prompt_tokens", "Of the cached prompt tokens, those pulled "
                                   "from the cache tier", registry=r)
        self.completion_tokens = Counter(f"{P}_completion_tokens", "Tokens generated for clients", registry=r)
        self.class_ttft = Histogram(f"{P}_class_ttft_seconds", "TTFT by SLO class", ["slo_class"],
                                    buckets=TTFT_BUCKETS, registry=r)
        self._slo = Counter(f"{P}_slo_requests", "Finished requests by SLO class and whether they met its TTFT "
                            "and TPOT targets (met | missed | none: the class sets none)",
                            ["slo_class", "ttft", "tpot"], registry=r)
        self._class = BoundedLabel("slo_class", cap=16)
        self._reason = BoundedLabel("reason", cap=16)
        self._role = BoundedLabel("role", cap=8)
        self._worker_keys: set[tuple[str, str]] = set()
        self._open = 0

    @staticmethod
    def _api(api: str) -> str:
        return api if api in APIS else OTHER

    def request_started(self, api: str) -> None:
        self._open += 1
        self.inflight.inc()

    def request_finished(self, api: str, outcome: str, ttft_s: float | None = None, tpot_s: float | None = None,
                         e2e_s: float | None = None, usage: Mapping[str, Any] | None = None) -> None:
        if self._open > 0:  # a finish without a start must not drive the gauge negative
            self._open -= 1
            self.inflight.dec()
        self._requests.labels(api=self._api(api), outcome=outcome_label(outcome)).inc()
        for hist, value in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.e2e, e2e_s)):
            if value is not None and value >= 0:
                hist.observe(value)
        if usage:
            prompt = _count(usage, "prompt_tokens")
            cached = min(_count(usage, "cached_tokens"), prompt)
            self.prompt_tokens.inc(prompt)
            self.cached_tokens.inc(cached)
            self.tier_tokens.inc(min(_count(usage, "tier_cached_tokens"), cached))
            self.completion_tokens.inc(_count(usage, "completion_tokens"))

    def class_finished(self, slo_class: str, ttft_s: float | None, tpot_s: float | None, ttft_target: float,
                       tpot_target: float) -> None:
        """A finished request of ``slo_class`` against its targets (0: none)."""
        name = self._class(slo_class)
        if ttft_s is not None and ttft_s >= 0:
            self.class_ttft.labels(slo_class=name).observe(ttft_s)

        def verdict(value: float | None, target: float) -> str:
            return "none" if not target else "met" if value is not None and value <= target else "missed"
        self._slo.labels(slo_class=name, ttft=verdict(ttft_s, ttft_target), tpot=verdict(tpot_s, tpot_target)).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=self._reason(reason)).inc()

    def failover(self) -> None:
        self.failovers.inc()

    def set_workers(self, table: Any, now: float | None = None) -> None:
        """Count ``table.workers`` (``WorkerState``: ``report.role``, ``report.draining``, ``last_seen``) by role
        and state, with ``table.dead_after_s`` deciding ``dead``."""
        now = time.monotonic() if now is None else now
        counts: dict[tuple[str, str], int] = {}
        for state in list(table.workers.values()):
            if now - state.last_seen >= table.dead_after_s:
                kind = "dead"
            else:
                kind = "draining" if state.report.draining else "alive"
            key = (self._role(state.report.role), kind)
            counts[key] = counts.get(key, 0) + 1
        for role, kind in self._worker_keys | set(counts):
            self._workers.labels(role=role, state=kind).set(counts.get((role, kind), 0))
        self._worker_keys |= set(counts)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The scrape body and its content type (refreshing the worker gauges from ``table`` when set)."""
        if self.table is not None:
            self.set_workers(self.table)
        return render(self.registry, accept)


def _count(usage: Mapping[str, Any], key: str) -> int:
    """A non-negative int from a usage field (absent, None or malformed: 0)."""
    try:
        return max(0, int(usage.get(key) or 0))
    except (TypeError, ValueError):
        return 0
