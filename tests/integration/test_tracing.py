"""One trace per request across router -> prefill -> KV hand-off -> decode (``shared/tracing.py``), on a real
nats-server with an in-memory span exporter: the client's ``traceparent`` (a NATS header) is the request span's
parent, the workers' spans join the trace through the headers of the dispatch and the hand-off, and the TTFT the
router measured is its gate + placement + the prefill worker's prefill, within the NATS hops' slack."""
import pytest

from shared import protocol, tracing
from shared.client import generate
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster
from tests.model_factory import write_tiny_hf_folder

TRACE_ID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=1024,
                                num_layers=4, hidden=128, ffn=256)


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter))
    try:
        yield exporter
    finally:
        tracing.uninstall()


async def test_a_remote_prefill_request_is_one_trace_whose_spans_add_up_to_its_ttft(nats_server, folder, spans):
    prompt = [(7 * i) % 250 + 3 for i in range(300)]
    request = protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
                                       prefill_mode="remote", transport="stream", request_id="traced")
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm,stream"):
        nc = await connect(nats_server.url)
        try:
            ids, _, usage = await generate(nc, request, headers={"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
        finally:
            await nc.close()
    assert len(ids) == 6
    got = {s.name.removeprefix("deepinfer."): s for s in spans.get_finished_spans()}
    assert {"request", "gate", "attempt", "placement", "prefill_request", "prefill", "kv_handoff", "decode",
            "kv_fetch"} <= set(got), sorted(got)
    assert {format(s.context.trace_id, "032x") for s in got.values()} == {TRACE_ID}   # one trace, the client's

    def parent(name: str) -> str:
        return next(k for k, s in got.items() if s.context.span_id == got[name].parent.span_id)
    assert format(got["request"].parent.span_id, "016x") == PARENT
    assert [parent(n) for n in ("gate", "attempt", "placement", "prefill_request", "prefill", "kv_handoff",
                                "decode", "kv_fetch")] == ["request", "request", "attempt", "attempt",
                                                           "prefill_request", "prefill_request", "prefill_request",
                                                           "decode"]
    request_span = got["request"]
    assert request_span.attributes["deepinfer.outcome"] == "finished"
    assert request_span.attributes["deepinfer.prompt_tokens"] == len(prompt)
    assert got["kv_handoff"].attributes["deepinfer.bytes"] == got["kv_fetch"].attributes["deepinfer.bytes"] > 0
    assert any(e.name == "first_token" for e in got["attempt"].events)
    seconds = {n: (s.end_time - s.start_time) / 1e9 for n, s in got.items()}
    parts = seconds["gate"] + seconds["placement"] + seconds["prefill"]
    ttft = usage["ttft_ms"] / 1000.0
    print(f"TTFT {ttft * 1000:.1f} ms = gate {seconds['gate'] * 1000:.2f} + placement "
          f"{seconds['placement'] * 1000:.2f} + prefill {seconds['prefill'] * 1000:.1f} ms + hops "
          f"{(ttft - parts) * 1000:.1f} ms")
    assert parts <= ttft + 0.005 and ttft - parts < 0.1 + 0.2 * ttft   # the NATS hops: dispatch and first chunk


async def test_a_live_migration_is_an_event_on_the_request_span(nats_server, folder, spans):
    from tests.integration.test_deepseek_services import migrated_stream

    prompt = [(5 * i) % 250 + 3 for i in range(40)]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm,stream",
                                router_kw={"migrate_skew_min": 0, "migrate_kv_high": 2.0}) as cluster:
        ack, chunks = await migrated_stream(nats_server.url, cluster, prompt, 200)
    request = next(s for s in spans.get_finished_spans() if s.name == "deepinfer.request")
    moved = [e for e in request.events if e.name == "migrated"]
    assert len(moved) == 1 and moved[0].attributes["deepinfer.target"] == ack.detail


async def test_a_failover_is_an_event_on_the_attempt_that_failed(nats_server, folder, spans):
    """The placement's first choice is a ghost decode worker (heartbeats, no responder): that attempt's span ends
    with a ``failover`` event naming why, the second attempt serves the request, both under one request span."""
    import asyncio

    from tests.integration.services_harness import wait_until
    from tests.integration.test_failover_dispatch import ghost_heartbeats, ghost_of

    request = protocol.GenerateRequest(prompt_token_ids=list(range(3, 40)), max_tokens=4, temperature=0.0,
                                       ignore_eos=True, prefill_mode="local")
    async with InProcessCluster(nats_server.url, folder, transports="shm") as cluster:
        real = next(w for w in cluster.workers if w.config.role == "decode")
        stop = asyncio.Event()
        beating = asyncio.create_task(ghost_heartbeats(nats_server.url, ghost_of(real, "decode"), stop))
        try:
            assert await wait_until(lambda: cluster.router.table.is_alive("a-ghost"))
            nc = await connect(nats_server.url)
            try:
                _, _, usage = await generate(nc, request)
            finally:
                await nc.close()
        finally:
            stop.set()
            await beating
    assert usage["failovers"] == 1
    done = spans.get_finished_spans()
    attempts = sorted((s for s in done if s.name == "deepinfer.attempt"), key=lambda s: s.start_time)
    request_span = next(s for s in done if s.name == "deepinfer.request")
    assert [a.attributes["deepinfer.placement"] for a in attempts] == [0, 1]
    failed = attempts[0].events   # the event, then the exception the span recorded as it ended
    assert [e.name for e in failed] == ["failover", "exception"] and "a-ghost" in failed[0].attributes["reason"]
    assert not attempts[0].status.is_ok and attempts[1].status.is_unset
    assert [e.name for e in attempts[1].events] == ["first_token"]
    assert all(a.parent.span_id == request_span.context.span_id for a in attempts)
    assert request_span.attributes["deepinfer.failovers"] == 1
