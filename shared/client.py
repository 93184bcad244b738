"""NATS request client for ``di.v1.generate``: what ``deepinfer generate --url`` and the tests use.

Protocol: publish a msgpack ``GenerateRequest`` to ``di.v1.generate`` with a reply inbox; the inbox receives
``TokenChunk``s with seq 0, 1, 2, … until one with ``final=True`` (usage, or an ``error``). A request the
router cannot even decode is answered with one ``ErrorReply``. Leaving early publishes a cancel. A stream whose
router dies continues through another router (``generate_stream``'s ``resume``).
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


PROBE_AFTER_S = 3.0    # a stream silent this long: ask whether a router still relays it (``di.v1.held``)
PROBE_TIMEOUT_S = 2.0  # no router answering within this: the one relaying it died
MAX_RESUMES = 3        # resumes of one stream through another router


async def _held(nc: nats.NATS, subject: str, request_id: str) -> bool:
    """Does a router still relay ``request_id``? Only its owner answers; silence or no responders is a no."""
    try:
        msg = await nc.request(subject, protocol.encode(protocol.RequestProbe(request_id=request_id)),
                               timeout=PROBE_TIMEOUT_S)
        return bool(protocol.decode_reply(msg.data, protocol.Ack).ok)
    except Exception:  # noqa: BLE001 - timeout, no responders, an error reply: nobody holds it
        return False


async def generate_stream(nc: nats.NATS, request: protocol.GenerateRequest, idle_timeout: float | None = None,
                          tenant: str | None = None, resume: bool = True,
                          headers: dict[str, str] | None = None) -> AsyncIterator[protocol.TokenChunk]:
    """Yield the request's chunks in order; raise ``DeepinferError`` on an error reply or a gap.

    ``idle_timeout`` (default: the request's timeout, else the router's ``MAX_REQUEST_S``, + 5 s) bounds the wait
    for each chunk. ``tenant``: send as that authenticated tenant (``di.v1.generate.<tenant>``, the NATS user
    ``client-<tenant>``'s subject).

    ``resume``: a stream silent for ``PROBE_AFTER_S`` asks the routers whether one still relays it; if none does
    (its router died), the request goes again to the routers' queue group with the tokens received so far
    (``resume_tokens``) and the next seq (``resume_seq``): another router continues after them as after a
    failover, so the caller sees one gap-free stream, each token once (at most ``MAX_RESUMES`` times).

    ``request.n`` > 1: chunks of all choices interleave (``index``, seq per choice) until each choice's final
    chunk; the first error ends the whole request. Such a stream is not resumed.

    ``headers``: NATS headers sent with the request, e.g. a W3C ``traceparent`` the router's trace continues.
    """
    generate_subject = subjects.generate_as(tenant) if tenant else subjects.GENERATE
    cancel_subject = subjects.cancel_as(tenant) if tenant else subjects.CANCEL
    held_subject = subjects.held_as(tenant) if tenant else subjects.HELD
    if not request.request_id:  # an id lets us cancel when we leave early
        request = dataclasses.replace(request, request_id=uuid.uuid4().hex)
    idle = idle_timeout if idle_timeout is not None else (request.timeout_s or protocol.MAX_REQUEST_S) + 5.0
    sub = None
    done = False
    received: list[int] = []
    expected, resumes = 0, 0
    resume = resume and request.n == 1
    choice_seq = [0] * request.n                 # n > 1: the next seq of each choice; a final ends its choice
    open_choices = request.n
    try:
        while True:  # one pass per router relaying the stream
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox, pending_msgs_limit=request.n * (request.max_tokens + 16))
            sent = request if not resumes else dataclasses.replace(
                request, resume_tokens=list(received), resume_seq=expected)
            await nc.publish(generate_subject, protocol.encode(sent), reply=inbox, headers=headers)
            silent = 0.0
            while True:
                wait = min(idle - silent, PROBE_AFTER_S) if resume else idle
                try:
                    msg = await sub.next_msg(timeout=wait)
                except asyncio.TimeoutError:
                    silent += wait
                    if silent >= idle:
                        raise DeepinferError(ErrorCode.TIMEOUT, f"no reply within {idle:.0f} s") from None
                    if await _held(nc, held_subject, request.request_id) or resumes >= MAX_RESUMES \
                            or len(received) >= request.max_tokens:
                        continue
                    break  # its router is gone: resume through another one
                silent = 0.0
                if not msg.data and msg.headers and msg.headers.get("Status") == "503":  # nats: no responders
                    done = True
                    raise DeepinferError(ErrorCode.UNAVAILABLE, f"no router serves {generate_subject}")
                reply = protocol.decode(msg.data, (protocol.TokenChunk, protocol.ErrorReply))
                if isinstance(reply, protocol.ErrorReply):
                    done = True
                    raise reply.to_exception()
                if request.n > 1:
                    if not 0 <= reply.index < request.n or reply.seq != choice_seq[reply.index]:
                        raise DeepinferError(ErrorCode.INTERNAL, f"choice {reply.index}: unexpected seq {reply.seq}")
                    choice_seq[reply.index] += 1
                    open_choices -= reply.final
                    if reply.final:
                        reply.raise_if_error()
                    done = open_choices == 0
                    yield reply
                    if done:
                        return
                    continue
                if reply.seq != expected:
                    raise DeepinferError(ErrorCode.INTERNAL, f"chunk seq {reply.seq}, expected {expected}")
                expected += 1
                received += reply.token_ids
                if reply.final:
                    done = True
                    reply.raise_if_error()
                yield reply
                if reply.final:
                    return
            resumes += 1
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    finally:
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if not done and request.request_id and nc.is_connected:
            with contextlib.suppress(Exception):
                await nc.publish(cancel_subject, protocol.encode(protocol.CancelRequest(request_id=request.request_id)))


async def generate_choices(nc: nats.NATS, request: protocol.GenerateRequest,
                           tenant: str | None = None) -> list[tuple[list[int], str, dict]]:
    """Collect every choice of a request (``n``): ``[(token_ids, text, usage)]`` by index."""
    ids, texts, usage = ([[] for _ in range(request.n)], [[] for _ in range(request.n)],
                         [{} for _ in range(request.n)])
    async for chunk in generate_stream(nc, request, tenant=tenant):
        ids[chunk.index] += chunk.token_ids
        texts[chunk.index].append(chunk.text)
        usage[chunk.index] = chunk.usage or usage[chunk.index]
    return [(ids[i], "".join(texts[i]), usage[i]) for i in range(request.n)]


async def generate(nc: nats.NATS, request: protocol.GenerateRequest,
                   tenant: str | None = None, headers: dict[str, str] | None = None) -> tuple[list[int], str, dict]:
    """Collect a whole response of one choice: ``(token_ids, text, usage)``."""
    ids, text, usage = [], [], {}
    async for chunk in generate_stream(nc, request, tenant=tenant, headers=headers):
        ids += chunk.token_ids
        text.append(chunk.text)
        usage = chunk.usage or usage
    return ids, "".join(text), usage
