"""A small client of the router's OpenAI-compatible HTTP API (what ``deepinfer up --demo`` and the HTTP benchmark
use; any OpenAI client works too). ``stream_events`` yields the parsed SSE payloads of one streaming call and
raises ``DeepinferError`` for an error status or an ``{"error": ...}`` event, with deepinfer's error code."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp

from shared.errors import DeepinferError, ErrorCode


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
