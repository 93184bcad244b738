"""The draft service's metrics (``deepinfer_draft_*``), every series labelled ``worker`` and ``drafter``.

Read at scrape time from the service's own counters (requests, proposals, proposed tokens; handler errors,
requests waiting); the latency histograms are the only events recorded here: ``request_seconds`` from
arrival to reply (includes waiting for the one drafting forward at a time), ``forward_seconds`` the proposal
itself. A decode worker gives up after its ``draft_timeout_s``; compare that with ``request_seconds``.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.registry import Collector

from shared.metrics.common import FAST_BUCKETS, counter, error_counts, gauge, new_registry

P = "deepinfer_draft"


class DraftMetrics:
    def __init__(self, worker_id: str, drafter: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self.labels = {"worker": worker_id, "drafter": drafter}  # one drafter per service: bounded
        names = list(self.labels)
        self.request_seconds = Histogram(f"{P}_request_seconds", "Arrival of a draft request to its reply",
                                         names, buckets=FAST_BUCKETS, registry=self.registry).labels(**self.labels)
        self.forward_seconds = Histogram(f"{P}_forward_seconds", "Time the drafter took to propose",
                                         names, buckets=FAST_BUCKETS, registry=self.registry).labels(**self.labels)

    def watch(self, service: Any) -> None:
        """Read ``service``'s counters at every scrape (``DraftCollector``); call once."""
        self.registry.register(DraftCollector(service, self.labels))


class DraftCollector(Collector):
    """Duck-typed on the service: ``served``, ``sequences``, ``tokens``, ``stale``, ``runtime``."""

    def __init__(self, service: Any, labels: dict[str, str]) -> None:
        self.service, self.labels = service, labels

    def collect(self):
        svc, lb = self.service, self.labels
        yield counter(f"{P}_requests", "Draft requests answered with proposals", lb, svc.served)
        yield counter(f"{P}_proposals", "Proposals served (one per sequence of a request)", lb, svc.sequences)
        yield counter(f"{P}_stale_requests", "Draft requests dropped: they waited past their budget_s", lb, svc.stale)
        yield counter(f"{P}_proposed_tokens", "Tokens drafted (proposed)", lb, svc.tokens)
        rt = getattr(svc, "runtime", None)
        if rt is not None:
            yield gauge(f"{P}_inflight_requests", "Draft requests being served or waiting for the drafter", lb,
                        rt.num_inflight)
            yield error_counts(P, lb, rt.error_counts)
