"""``shared/http_client.complete``: a non-streaming call moves on past routers that are gone or answer 503, and
is never sent twice once a router answered anything else (a real aiohttp server; a closed port for a dead one)."""
from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from shared.errors import DeepinferError, ErrorCode
from shared.http_client import complete
from shared.nats_server import free_port


async def serve(statuses: list[int]) -> tuple[web.AppRunner, str, list[dict]]:
    """A router stand-in answering each call with the next of ``statuses`` (OpenAI-style error bodies)."""
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        status = statuses[min(len(seen), len(statuses)) - 1]
        if status == 200:
            return web.json_response({"choices": [{"text": "ok"}]})
        code = {503: "unavailable", 400: "invalid_request"}[status]
        return web.json_response({"error": {"code": code, "message": "no"}}, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", seen


async def test_a_dead_router_and_a_503_are_passed_over():
    runner, url, seen = await serve([503, 200])
    dead = f"http://127.0.0.1:{free_port()}"          # nothing listens: connection refused
    try:
        async with aiohttp.ClientSession() as session:
            got = await complete(session, [dead, url], "/v1/completions", {"prompt": "x"}, attempts=4, backoff_s=0)
    finally:
        await runner.cleanup()
    assert got["choices"][0]["text"] == "ok"
    assert len(seen) == 2 and all(body["stream"] is False for body in seen)   # 503, then the answer


async def test_an_answered_error_is_not_retried():
    runner, url, seen = await serve([400])
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(DeepinferError) as err:
                await complete(session, [url, url], "/v1/completions", {"prompt": "x"}, backoff_s=0)
    finally:
        await runner.cleanup()
    assert err.value.code is ErrorCode.INVALID_REQUEST and len(seen) == 1


async def test_attempts_are_bounded():
    dead = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(DeepinferError) as err:
            await complete(session, [dead], "/v1/completions", {"prompt": "x"}, attempts=3, backoff_s=0)
    assert err.value.code is ErrorCode.WORKER_LOST and "3 attempts" in str(err.value)
