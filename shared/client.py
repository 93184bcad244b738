"""NATS request client for ``di.v1.generate``: what ``deepinfer generate --url`` and the tests use.

Protocol: publish a msgpack ``GenerateRequest`` to ``di.v1.generate`` with a reply inbox; the inbox receives
``TokenChunk``s with seq 0, 1, 2, … until one with ``final=True`` (usage, or an ``error``). A request the
router cannot even decode is answered with one ``ErrorReply``. Leaving early publishes a cancel.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator

import nats

from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode


async def generate_stream(nc: nats.NATS, request: protocol.GenerateRequest, idle_timeout: float | None = None,
                          tenant: str | None = None) -> AsyncIterator[protocol.TokenChunk]:
    """Yield the request's chunks in order; raise ``DeepinferError`` on an error reply or a gap.

    ``idle_timeout`` (default: the request's timeout, else the router's ``MAX_REQUEST_S``, + 5 s) bounds the wait
    for each chunk. ``tenant``: send
    as that authenticated tenant (``di.v1.generate.<tenant>``, the NATS user ``client-<tenant>``'s subject).
    """
    generate_subject = subjects.generate_as(tenant) if tenant else subjects.GENERATE
    cancel_subject = subjects.cancel_as(tenant) if tenant else subjects.CANCEL
    if not request.request_id:  # an id lets us cancel when we leave early
        request = dataclasses.replace(request, request_id=uuid.uuid4().hex)
    idle = idle_timeout if idle_timeout is not None else (request.timeout_s or protocol.MAX_REQUEST_S) + 5.0
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, pending_msgs_limit=request.max_tokens + 16)
    done = False
    try:
        await nc.publish(generate_subject, protocol.encode(request), reply=inbox)
        expected = 0
        while True:
            try:
                msg = await sub.next_msg(timeout=idle)
            except asyncio.TimeoutError:
                raise DeepinferError(ErrorCode.TIMEOUT, f"no reply within {idle:.0f} s") from None
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":  # nats: no responders
                done = True
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"no router serves {generate_subject}")
            reply = protocol.decode(msg.data, (protocol.TokenChunk, protocol.ErrorReply))
            if isinstance(reply, protocol.ErrorReply):
                done = True
                raise reply.to_exception()
            if reply.seq != expected:
                raise DeepinferError(ErrorCode.INTERNAL, f"chunk seq {reply.seq}, expected {expected}")
            expected += 1
            if reply.final:
                done = True
                reply.raise_if_error()
            yield reply
            if reply.final:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if not done and request.request_id and nc.is_connected:
            with contextlib.suppress(Exception):
                await nc.publish(cancel_subject, protocol.encode(protocol.CancelRequest(request_id=request.request_id)))


async def generate(nc: nats.NATS, request: protocol.GenerateRequest,
                   tenant: str | None = None) -> tuple[list[int], str, dict]:
    """Collect a whole response: ``(token_ids, text, usage)``."""
    ids, text, usage = [], [], {}
    async for chunk in generate_stream(nc, request, tenant=tenant):
        ids += chunk.token_ids
        text.append(chunk.text)
        usage = chunk.usage or usage
    return ids, "".join(text), usage
