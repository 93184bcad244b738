"""A small client of the router's OpenAI-compatible HTTP API (what ``deepinfer up --demo`` and the HTTP benchmark
use; any OpenAI client works too). ``stream_events`` yields the parsed SSE payloads of one streaming call and
raises ``DeepinferError`` for an error status or an ``{"error": ...}`` event, with deepinfer's error code.

``complete`` makes one non-streaming call against a list of routers' URLs and retries it on the next URL when
the router it asked is gone (connection refused or dropped before a response: a router killed mid-request) or
answers 503 (draining); a request that got any other answer, even an error, is never sent twice. A retry
generates again from the prompt: greedy and seeded outputs are the same, and the dead router's workers stop its
copy within ``router_dead_after_s`` (``services/worker/router_watch.py``). An HTTP *stream* cannot move between routers:
its client sees the connection drop (the NATS client, ``shared/client.py``, resumes streams instead)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence

import aiohttp

from shared.errors import DeepinferError, ErrorCode

log = logging.getLogger(__name__)

GONE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)   # refused, reset, dropped mid-response


def _error(payload: dict, status: int) -> DeepinferError:
    err = payload.get("error") or {}
    try:
        code = ErrorCode(err.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    return DeepinferError(code, f"HTTP {status}: {err.get('message', payload)}")


async def stream_events(session: aiohttp.ClientSession, url: str, body: dict,
                        api_key: str = "") -> AsyncIterator[dict]:
    """POST ``body`` with ``stream: true`` to ``url`` and yield each event until ``data: [DONE]``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.post(url, json={**body, "stream": True}, headers=headers) as resp:
        if resp.status != 200:
            try:
                payload = await resp.json(content_type=None)
            except (ValueError, aiohttp.ContentTypeError):
                payload = {"error": {"message": (await resp.text())[:200]}}
            raise _error(payload, resp.status)
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                return
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise _error(event, resp.status)
            yield event
        raise DeepinferError(ErrorCode.WORKER_LOST, "the stream ended without [DONE]")


async def complete(session: aiohttp.ClientSession, urls: Sequence[str], path: str, body: dict, api_key: str = "",
                   attempts: int = 3, backoff_s: float = 0.5) -> dict:
    """POST non-streaming ``body`` to ``<url><path>`` for the first of ``urls`` that answers and return the JSON
    response; on a router that is gone or unavailable (503: draining, or no worker known to it) try the next URL
    (cycling, up to ``attempts`` tries in all, ``backoff_s`` apart). Any other error status raises
    ``DeepinferError`` at once."""
    if not urls or attempts < 1:
        raise ValueError("complete needs at least one URL and one attempt")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last: Exception | None = None
    for attempt in range(attempts):
        url = urls[attempt % len(urls)].rstrip("/") + path
        try:
            async with session.post(url, json={**body, "stream": False}, headers=headers) as resp:
                try:
                    payload = await resp.json(content_type=None)
                except ValueError:
                    payload = {"error": {"message": (await resp.text())[:200]}}
                if resp.status == 200:
                    return payload
                err = _error(payload, resp.status)
                if err.code is not ErrorCode.UNAVAILABLE:
                    raise err
                last = err
        except GONE as exc:
            last = exc
        log.info("%s did not answer (%s): retrying on the next router", url, last)
        await asyncio.sleep(backoff_s)
    raise DeepinferError(ErrorCode.WORKER_LOST, f"no router answered after {attempts} attempts: {last}")
