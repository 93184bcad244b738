"""What every metric set shares: a private registry per service, histogram buckets, bounded label values,
rendering with content negotiation, and the small helpers custom collectors use.

Invariants:
- Every service instance owns one ``CollectorRegistry`` (``new_registry``); nothing here touches
  prometheus_client's global default registry, so several services in one process never collide.
- Label values are bounded: fixed vocabularies, or ``BoundedLabel`` (at most ``cap`` distinct values, then
  ``OTHER``). Request ids, tenants and prompts never become label values.
- Names follow ``deepinfer_<subsystem>_<name>_<unit>``; counters end in ``_total`` on the wire.
"""
from __future__ import annotations

import logging
from functools import partial
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics_exposition

from shared.errors import ErrorCode

logger = logging.getLogger(__name__)

OTHER = "other"

# Buckets in seconds: from CPU-sized models (hundreds of ms per token) to GPU-sized ones (ms per token).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # drafts, tier ops

# a request's end as a label value: success, or the error code that ended it
OUTCOME_FINISHED = "finished"
OUTCOME_CANCELLED = "cancelled"
OUTCOMES = frozenset({OUTCOME_FINISHED, OUTCOME_CANCELLED, *(c.value for c in ErrorCode)})


def new_registry(process: bool = True) -> CollectorRegistry:
    """A fresh registry for one service instance; ``process``: with the ``process_*`` metrics (CPU seconds,
    resident memory, open fds) of this process."""
    registry = CollectorRegistry()
    if process:
        ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """``(body, content_type)`` of a scrape: OpenMetrics when ``accept`` asks for it, else Prometheus text.
    OpenMetrics names go as they are unless the scraper asks for an escaping: prometheus_client escapes ``:`` in
    sample names by default (``vllm:num_requests_running`` samples came out as ``vllm_num_requests_running`` under
    a ``vllm:`` TYPE line, and Prometheus, which asks for OpenMetrics first, stored no ``vllm:`` series); every name
    here is a classic Prometheus name, colons included (``benchmarks/dashboard_snapshot.py`` found it)."""
    encoder, content_type = choose_encoder(accept)
    if content_type.startswith("application/openmetrics-text") and "escaping=" not in accept:
        encoder = partial(openmetrics_exposition.generate_latest, escaping=openmetrics_exposition.ALLOWUTF8)
        content_type = openmetrics_exposition.CONTENT_TYPE_LATEST
    return encoder(registry), content_type


def outcome_label(outcome: str) -> str:
    """``outcome`` if it is in the vocabulary (``OUTCOMES``), else ``OTHER``."""
    return outcome if outcome in OUTCOMES else OTHER


class BoundedLabel:
    """Passes through the first ``cap`` distinct values of a label, then answers ``OTHER`` (logged once):
    a label fed from outside (a reason string, a heartbeat's role) can never grow a series set unbounded."""

    def __init__(self, name: str, cap: int = 16) -> None:
        self.name, self.cap = name, cap
        self.seen: set[str] = set()
        self._warned = False

    def __call__(self, value: str) -> str:
        value = str(value)
        if value in self.seen:
            return value
        if len(self.seen) < self.cap:
            self.seen.add(value)
            return value
        if not self._warned:
            self._warned = True
            logger.warning("metric label %s has %d values; %r and later ones are counted as %r",
                           self.name, self.cap, value, OTHER)
        return OTHER


def counter(name: str, doc: str, labels: Mapping[str, str], value: float) -> CounterMetricFamily:
    """A one-sample counter family (``name`` without ``_total``; the exposition adds it)."""
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def gauge(name: str, doc: str, labels: Mapping[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _family_by(cls, name: str, doc: str, labels: Mapping[str, str], key: str,
               values: Iterable[tuple[str, float]]):
    family = cls(name, doc, labels=[*labels, key])
    for label, value in values:
        family.add_metric([*labels.values(), label], value)
    return family


def counter_by(name: str, doc: str, labels: Mapping[str, str], key: str,
               values: Iterable[tuple[str, float]]) -> CounterMetricFamily:
    """A counter family with one sample per ``(key value, count)`` in ``values``, besides the fixed labels."""
    return _family_by(CounterMetricFamily, name, doc, labels, key, values)


def gauge_by(name: str, doc: str, labels: Mapping[str, str], key: str,
             values: Iterable[tuple[str, float]]) -> GaugeMetricFamily:
    """The gauge counterpart of ``counter_by``."""
    return _family_by(GaugeMetricFamily, name, doc, labels, key, values)


def error_counts(prefix: str, labels: Mapping[str, str], counts: Mapping[str, int]) -> CounterMetricFamily:
    """``<prefix>_handler_errors_total{code}``: error replies of the service's handlers (``ServiceRuntime``
    counts them by error code; the codes are a fixed vocabulary)."""
    by_code: dict[str, int] = {}
    for code, n in dict(counts).items():
        by_code[outcome_label(code)] = by_code.get(outcome_label(code), 0) + n
    return counter_by(f"{prefix}_handler_errors", "Handler errors answered with an error reply, by code",
                      labels, "code", sorted(by_code.items()))
