"""OpenTelemetry tracing: one trace per request across router -> prefill -> KV hand-off -> decode, W3C trace
context carried in NATS headers (``traceparent``) and honoured on HTTP.

On when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (spans batched to that OTLP/HTTP collector; ``OTEL_SERVICE_NAME``
or the service's own name), or after ``install(processor)`` (tests: an in-memory exporter). Off otherwise, and
then free: ``span`` hands out one shared no-op span, ``headers`` returns None (messages go without headers) and
opentelemetry is never imported.

Spans (``deepinfer.*``; attributes name workers, counts and outcomes, never prompts or tokens):
- router: ``request`` (the entry: API, request id, SLO class, prompt / cached / completion tokens, TTFT, outcome),
  ``gate`` (the wait for a dispatch slot), ``placement`` (the chosen workers and transport), ``attempt`` (one
  placement's life; events ``first_token``, and ``failover`` / ``refused`` when it ends so; a live migration
  adds ``migrated`` to the request span);
- prefill worker: ``prefill`` (tier pull included, until its first token is published: tokens, cached and tier
  tokens), ``kv_handoff`` (staging and the decode worker's acknowledgement: transport, bytes);
- decode worker: ``decode`` (its tokens; events ``first_token``), ``kv_fetch`` (a hand-off's bytes).
A remote-prefill request's TTFT at the router is ``gate + placement + prefill`` plus NATS hops
(``tests/integration/test_tracing.py``).

Invariant: a span's context manager never raises for tracing's sake; a span whose work raised records the error.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_tracer = None            # the opentelemetry tracer once on
_propagator = None
_provider = None


class _NoSpan:
    """What ``span`` yields while tracing is off: every call is a no-op."""
    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass


NO_SPAN = _NoSpan()


def on() -> bool:
    return _tracer is not None


def setup(service: str) -> bool:
    """Turn tracing on for this process when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (once; later calls keep the
    first). Returns whether tracing is on."""
    if _tracer is not None or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    install(BatchSpanProcessor(OTLPSpanExporter()), os.environ.get("OTEL_SERVICE_NAME") or f"deepinfer-{service}")
    logger.info("tracing to %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return True


def install(processor, service: str = "deepinfer") -> None:
    """Trace through ``processor`` (an opentelemetry ``SpanProcessor``) from now on, in this process."""
    global _tracer, _propagator, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(processor)
    _tracer, _propagator, _provider = provider.get_tracer("deepinfer"), TraceContextTextMapPropagator(), provider


def flush(timeout_s: float = 5.0) -> None:
    """Send the spans still batched (a service stopping); nothing while off."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def uninstall() -> None:
    """Tracing off again (tests)."""
    global _tracer, _propagator, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _propagator = _provider = None


def context_of(carrier: Mapping[str, str] | None):
    """The trace context a message's headers (or an HTTP request's) carry, or None."""
    if _tracer is None or not carrier:
        return None
    return _propagator.extract({k.lower(): v for k, v in carrier.items()})


def headers() -> dict[str, str] | None:
    """``traceparent`` (and ``tracestate``) of the current span, for a NATS message; None while off."""
    if _tracer is None:
        return None
    out: dict[str, str] = {}
    _propagator.inject(out)
    return out or None


def event(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on the current span (none while off)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, dict(attributes or {}))


def record(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None) -> None:
    """A finished ``deepinfer.<name>`` span, child of the current one, that ran from ``start_ns`` to ``end_ns``
    (``time.time_ns()``): a wait measured around code that is not a block of its own (none while off)."""
    if _tracer is None:
        return
    done = _tracer.start_span(f"deepinfer.{name}", start_time=start_ns, attributes=dict(attributes or {}))
    done.end(end_time=end_ns)


@contextlib.contextmanager
def span(name: str, parent=None, attributes: Mapping[str, Any] | None = None, server: bool = False) -> Iterator:
    """A ``deepinfer.<name>`` span, current while the block runs, child of ``parent`` (a ``context_of``) or of the
    current span; ``server``: the service's entry for this request."""
    if _tracer is None:
        yield NO_SPAN
        return
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    with _tracer.start_as_current_span(f"deepinfer.{name}", context=parent, kind=kind,
                                       attributes=dict(attributes or {})) as current:
        yield current
