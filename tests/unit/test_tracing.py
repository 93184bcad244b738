"""Tracing off costs nothing (``shared/tracing.py``): no opentelemetry import, one shared no-op span, no headers;
on, a W3C ``traceparent`` in any header case is the parent, and what ``headers`` injects continues the trace."""
import subprocess
import sys

import pytest

from shared import tracing


def test_off_by_default_without_opentelemetry_and_without_headers():
    code = ("import sys; from shared import tracing; tracing.setup('router');"
            "cm = tracing.span('request'); s = cm.__enter__(); s.set_attribute('a', 1); cm.__exit__(None, None, None);"
            "tracing.event('x'); tracing.record('gate', 0, 1);"
            "assert tracing.headers() is None and tracing.context_of({'traceparent': 'x'}) is None;"
            "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'imported'; print('ok')")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    with tracing.span("request") as span:
        assert span is tracing.NO_SPAN


@pytest.fixture
def exporter():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exp))
    yield exp
    tracing.uninstall()


def test_an_incoming_traceparent_is_the_parent_and_headers_continue_the_trace(exporter):
    incoming = {"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}   # as HTTP sends it
    with tracing.span("request", tracing.context_of(incoming), server=True):
        sent = tracing.headers()
        tracing.record("gate", 1_000, 2_000, {"deepinfer.priority": 0})
    assert sent["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    with tracing.span("decode", tracing.context_of(sent)):
        pass
    done = {s.name: s for s in exporter.get_finished_spans()}
    assert set(done) == {"deepinfer.request", "deepinfer.gate", "deepinfer.decode"}
    assert format(done["deepinfer.request"].parent.span_id, "016x") == "b7ad6b7169203331"
    assert done["deepinfer.gate"].parent.span_id == done["deepinfer.request"].context.span_id
    assert done["deepinfer.decode"].parent.span_id == done["deepinfer.request"].context.span_id
    assert (done["deepinfer.gate"].start_time, done["deepinfer.gate"].end_time) == (1_000, 2_000)


def test_with_an_otlp_endpoint_a_service_exports_its_spans_over_http(tmp_path):
    """``OTEL_EXPORTER_OTLP_ENDPOINT`` set: ``setup`` turns tracing on, and a flushed span reaches the collector
    (a local HTTP server standing in for one) as an OTLP/HTTP protobuf POST to ``/v1/traces``."""
    import http.server
    import threading

    posts: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):   # noqa: N802 - http.server's name
            posts.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = ("from shared import tracing; assert tracing.setup('router');"
            "cm = tracing.span('request', attributes={'deepinfer.api': 'nats'}); cm.__enter__();"
            "cm.__exit__(None, None, None); tracing.flush(); print('ok')")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert out.stdout.strip() == "ok", out.stderr
    assert [path for path, _ in posts] == ["/v1/traces"]
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    sent = ExportTraceServiceRequest.FromString(posts[0][1])
    spans = [s for rs in sent.resource_spans for ss in rs.scope_spans for s in ss.spans]
    service = {a.value.string_value for rs in sent.resource_spans for a in rs.resource.attributes
               if a.key == "service.name"}
    assert [s.name for s in spans] == ["deepinfer.request"] and service == {"deepinfer-router"}
