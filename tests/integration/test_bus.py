"""The service runtime against a real nats-server: a connection NATS closes for good stops the service with a
failing exit code instead of leaving it deaf; a close the service asked for does not."""
import asyncio
import time

from shared import protocol
from shared.bus import ServiceRuntime, connect


def info(wid: str) -> protocol.WorkerInfo:
    return protocol.WorkerInfo(worker_id=wid, role="decode", model_id="m", host="h", pid=1, transports=[],
                               block_size=16, started_at=time.time())


async def test_connection_closed_by_the_server_stops_the_service(nats_server):
    holder: list[ServiceRuntime] = []
    nc = await connect(nats_server.url, "victim", on_closed=lambda: holder[0].connection_closed())
    runtime = ServiceRuntime(nc, info("victim"))
    holder.append(runtime)
    await nc.publish("x" * 5000, b"")  # the server answers -ERR 'maximum control line exceeded'; nats-py gives up
    await asyncio.wait_for(runtime.stop_requested.wait(), 10)
    assert runtime.connection_lost and nc.is_closed


async def test_a_requested_close_is_not_a_lost_connection(nats_server):
    holder: list[ServiceRuntime] = []
    nc = await connect(nats_server.url, "calm", on_closed=lambda: holder[0].connection_closed())
    runtime = ServiceRuntime(nc, info("calm"))
    holder.append(runtime)
    await runtime.close()
    await asyncio.sleep(0.2)
    assert nc.is_closed and not runtime.connection_lost and not runtime.stop_requested.is_set()


async def test_client_reports_a_missing_router_as_unavailable(nats_server):
    from shared.client import generate
    from shared.errors import DeepinferError, ErrorCode

    nc = await connect(nats_server.url, "client")
    try:
        try:
            await generate(nc, protocol.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2, timeout_s=2.0))
        except DeepinferError as err:
            assert err.code == ErrorCode.UNAVAILABLE and "no router" in err.message
        else:
            raise AssertionError("a request nobody serves must fail")
    finally:
        await nc.close()


async def test_error_replies_carry_the_error_headers(nats_server):
    from shared.errors import DeepinferError, ErrorCode

    nc = await connect(nats_server.url, "svc")
    runtime = ServiceRuntime(nc, info("svc"))

    async def refuse(msg):
        raise DeepinferError(ErrorCode.OVERLOADED, "too busy")

    await runtime.serve("test.refuse", refuse)
    try:
        reply = await nc.request("test.refuse", b"", timeout=5)
        assert protocol.decode(reply.data, protocol.ErrorReply).code == "overloaded"
        assert reply.headers["Di-Error-Code"] == "overloaded" and reply.headers["Nats-Service-Error-Code"] == "429"
    finally:
        await runtime.close()


async def test_work_handlers_are_bounded(nats_server):
    """More concurrent work than ``max_inflight`` is refused ``overloaded`` at once, not queued without bound."""
    import asyncio as aio

    nc = await connect(nats_server.url, "busy")
    runtime = ServiceRuntime(nc, info("busy"), max_inflight=2)
    release = aio.Event()

    async def slow(msg):
        await release.wait()
        await msg.respond(protocol.encode(protocol.Ack()))

    await runtime.serve("test.slow", slow)
    try:
        calls = [aio.create_task(nc.request("test.slow", b"", timeout=5)) for _ in range(5)]
        await aio.sleep(0.3)
        release.set()
        answers = [protocol.decode(r.data, (protocol.Ack, protocol.ErrorReply)) for r in await aio.gather(*calls)]
        refused = [a for a in answers if isinstance(a, protocol.ErrorReply)]
        assert len(refused) == 3 and all(a.code == "overloaded" for a in refused)
    finally:
        await runtime.close()
