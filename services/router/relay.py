"""Serving one client stream: place, dispatch, relay chunks, fail over.

Per request: pick a decode worker and (unless the policy prefills locally) a prefill worker and a KV
transport; dispatch; relay the workers' token chunks to the client's reply subject with one gap-free ``seq``;
enforce the request's deadline. An attempt that fails for a reason another placement can fix raises
``AttemptFailed`` (retryable by construction) naming the workers to avoid: a worker that did not accept
(no responders, dispatch timeout, ``unavailable``/``overloaded``/``model_mismatch`` reply, e.g. a draining
worker or one now serving another model build), a worker that stops heartbeating, or a worker that reports its
partner lost, a failed or refused hand-off (``model_mismatch``: the decode worker's build is not the prefill
worker's), or hands the stream back while draining; also an attempt whose chunks were lost in transit (a gap in
the workers' numbering, or a silence in which no worker holds the request any more). The stream is then
re-placed with prompt + the tokens already delivered, up to ``max_failovers`` times, so the client sees one
stream with no gap or duplicate. A worker that answered with a refusal (draining, overloaded, another build: it
is alive and started nothing) is not a failover: those re-placements are bounded by ``max_refusals`` apart, and
``usage["failovers"]`` counts only attempts that a worker's loss or a lost hand-off / chunk ended
(greedy output is exactly the uninterrupted one; a sampled continuation draws afresh from the same
distribution). Every other error ends the stream with that error.

A live migration (``services/router/migration.py``) moves an attempt to another decode worker without ending
it: the new worker continues the attempt's chunk numbering, and the attempt watches it from then on.

Model builds: every attempt runs on workers of one model fingerprint (``services/router/models.py``); a
stream's continuations stay on the build of its first attempt while that build has a decode worker, so its
tokens come from one build and no KV ever crosses builds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from shared import protocol, subjects, tracing
from shared.errors import DeepinferError, ErrorCode
from shared.kv.transport import transfer_timeout
from shared.wire_fields import MAX_ID_LEN
from services.router.placement import Placer
from services.router.workers import InflightAccount, WorkerState, WorkerTable

logger = logging.getLogger(__name__)

# codes after which another placement may succeed (the failed workers are avoided)
RETRYABLE_CODES = frozenset(c.value for c in (ErrorCode.WORKER_LOST, ErrorCode.TRANSFER_FAILED,
                                               ErrorCode.UNAVAILABLE, ErrorCode.OVERLOADED,
                                               ErrorCode.MODEL_MISMATCH))


class AttemptFailed(DeepinferError):
    """An attempt failed in a way another placement may fix; ``workers`` (possibly none, for a message lost in
    transit) are avoided by the next attempt while their role has others."""

    def __init__(self, code: ErrorCode, message: str, workers: set[str], refused: bool = False) -> None:
        super().__init__(code, message)
        self.workers = workers
        self.refused = refused  # the worker answered that it takes no work now: nothing of the attempt ran


@dataclasses.dataclass(slots=True)
class Stream:
    """One client stream across failover attempts: what the client has received so far. ``send`` delivers a
    chunk to the client (a NATS publish to its reply subject, or the HTTP API's bounded queue)."""
    rid: str
    send: Callable[[protocol.TokenChunk], Awaitable[None]]
    prompt_len: int
    deadline: float
    t0: float = dataclasses.field(default_factory=time.monotonic)
    ttft_s: float | None = None
    next_seq: int = 0  # seq of the next chunk to the client
    delivered: list[int] = dataclasses.field(default_factory=list)
    ended: bool = False
    usage: dict | None = None  # the final chunk's usage, once forwarded
    failed_workers: set[str] = dataclasses.field(default_factory=set)  # not placed on again by this stream
    fingerprint: str | None = None  # the model build of its first attempt: continuations stay on it
    resumed: bool = False  # a client's resume after its router died: ``delivered`` came with the request
    attempt: Attempt | None = None  # the attempt under way (None between attempts)
    migrations: int = 0  # live migrations between decode workers so far
    moved_at: float | None = None  # monotonic time of the last one
    max_tokens: int = 0  # the request's, for the tokens it still has to go
    holders: dict[str, int] = dataclasses.field(default_factory=dict)  # Placer.place's: a sibling choice's worker
    retention: str = ""  # the retention class the request got (its own or the API's default), told in usage
    slo_class: str = ""  # the SLO class it runs in (shared/slo_classes.py), told in usage
    priority: int = 0  # its request's, its class's shift included (the migration policy moves batch first)
    span: Any = tracing.NO_SPAN  # its request span (``shared/tracing.py``): migrations add events to it
    ttft_target_s: float | None = None  # refuse placements predicted to start later than this (None: never)

    def whole_usage(self, usage: dict, completion_tokens: int, failovers: int) -> dict:
        """The last worker's ``usage`` made the whole stream's (prompt, tokens, TTFT across attempts)."""
        return {**usage, "prompt_tokens": self.prompt_len, "completion_tokens": completion_tokens,
                "ttft_ms": (self.ttft_s or 0.0) * 1000.0, "failovers": failovers,
                **({"retention": self.retention} if self.retention else {}),
                **({"slo_class": self.slo_class} if self.slo_class else {}),
                **({"resumed": 1} if self.resumed else {}), **({"migrations": self.migrations} if self.migrations
                                                              else {})}


@dataclasses.dataclass(slots=True)
class Attempt:
    """One attempt under way: its work id and the workers running it now (a live migration moves it to another
    decode worker: ``services/router/migration.py``)."""
    work_id: str
    prefill_w: WorkerState | None
    decode_w: WorkerState
    account: InflightAccount
    decoding: bool = False  # the decode worker streams: its running KV can move
    migrating: bool = False

    @property
    def worker_ids(self) -> set[str]:
        return {w.report.worker_id for w in (self.prefill_w, self.decode_w) if w is not None}


class Relay:
    """Serves streams for the router: ``serve(req, prompt, stream)`` returns once the client got its final
    chunk, or raises the error that ends the stream (the caller publishes it as the final chunk)."""

    def __init__(self, nc, placer: Placer, table: WorkerTable, dispatch_timeout_s: float,
                 max_failovers: int, stall_probe_s: float = 2.0,
                 on_failover: Callable[[], None] = lambda: None, router: tuple[str, str] = ("", ""),
                 max_refusals: int = 4, worker_wait_s: float = 0.0) -> None:
        self.nc, self.placer, self.table = nc, placer, table
        self.router_id, self.router_instance = router  # named in work messages: workers drop work of a dead relay
        self.on_failover = on_failover
        self.dispatch_timeout_s, self.max_failovers, self.max_refusals = dispatch_timeout_s, max_failovers, max_refusals
        self.stall_probe_s, self.worker_wait_s = stall_probe_s, worker_wait_s
        self.live: dict[str, Stream] = {}  # client request id -> its stream, while this router relays it
        self.listening_since = time.monotonic()   # before a whole heartbeat window, an unseen role may still beat

    async def serve(self, req: protocol.GenerateRequest, prompt: list[int], stream: Stream) -> None:
        self.live[stream.rid] = stream
        stream.max_tokens = req.max_tokens
        try:
            await self._serve(req, prompt, stream)
        finally:
            self.live.pop(stream.rid, None)

    async def _serve(self, req: protocol.GenerateRequest, prompt: list[int], stream: Stream) -> None:
        placement = failovers = refusals = 0  # placements number the workers' ids; the others bound retries
        while True:
            try:
                with tracing.span("attempt", attributes={"deepinfer.placement": placement}) as span:
                    try:
                        await self._attempt(req, prompt, stream, placement, failovers)
                    except AttemptFailed as err:
                        span.add_event("refused" if err.refused else "failover", {"reason": err.message})
                        raise
                return
            except AttemptFailed as err:
                if stream.ended or stream.deadline <= time.monotonic():
                    raise
                if err.refused:
                    if refusals >= self.max_refusals:
                        raise
                    refusals += 1
                else:
                    if failovers >= self.max_failovers:
                        raise
                    failovers += 1
                    self.on_failover()
                placement += 1
                stream.failed_workers.update(err.workers)
                logger.log(logging.INFO if err.refused else logging.WARNING,
                           "[%s] %s; re-placing with %d tokens delivered (%s %d)", stream.rid, err.message,
                           len(stream.delivered), "refusal" if err.refused else "failover",
                           refusals if err.refused else failovers)

    async def _attempt(self, req: protocol.GenerateRequest, prompt: list[int], stream: Stream,
                       placement: int, failovers: int) -> None:
        """Place and run the request once (the stream's ``placement``-th try, after ``failovers`` failovers),
        continuing after the tokens ``stream`` already delivered."""
        params = req.sampling()
        if stream.delivered:
            left = params.max_tokens - len(stream.delivered)
            if left <= 0:  # the worker died between the last token and the final chunk
                await self.forward(stream, protocol.TokenChunk(
                    request_id=stream.rid, seq=0, token_ids=[], final=True, finish_reason="length",
                    usage=stream.whole_usage({}, len(stream.delivered), failovers)))
                return
            params = dataclasses.replace(params, prompt_logprobs=None)   # the client has them
        prior = list(stream.delivered)   # the engine recomputes their KV and counts them as output
        # workers see their own id per attempt: the router's cancel of a dead attempt (on di.v1.cancel, which
        # the router itself listens to for clients) must not cancel the client's request
        work_id = attempt_id(stream.rid, placement)
        await self._await_workers(stream, ("decode", "prefill") if req.prefill_mode == "remote" else ("decode",))
        with tracing.span("placement") as span:
            prefill_w, decode_w, transport, build = self.placer.place(
                work_id, prompt + prior, params.max_tokens - len(prior), req.cache_salt, req.prefill_mode,
                req.transport, exclude=stream.failed_workers, fingerprint=stream.fingerprint, holders=stream.holders,
                ttft_slo_s=stream.ttft_target_s)
            span.set_attributes({"deepinfer.decode_worker": decode_w.report.worker_id,
                                 "deepinfer.prefill_worker": prefill_w.report.worker_id if prefill_w else "",
                                 "deepinfer.transport": transport or ""})
        stream.fingerprint = build
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, pending_msgs_limit=params.max_tokens + 16)
        computing = prefill_w or decode_w       # a sibling's prompt KV there: only the rest is prefill work
        held = stream.holders.get(computing.report.worker_id, 0) // max(1, computing.report.block_size)
        account = InflightAccount(prefill_w, decode_w, len(prompt) + len(prior) - held * computing.report.block_size)
        stream.attempt = Attempt(work_id, prefill_w, decode_w, account)
        finished = False
        try:
            deadline_s = stream.deadline - time.monotonic()
            if prefill_w is not None:
                target = prefill_w
                work = protocol.PrefillRequest(request_id=work_id, prompt_token_ids=prompt, sampling=params,
                                               decode_worker=decode_w.report.worker_id, transport=transport,
                                               reply_to=inbox, cache_salt=req.cache_salt, deadline_s=deadline_s,
                                               retention=req.retention, model_fingerprint=build,
                                               router_id=self.router_id, router_instance=self.router_instance,
                                               prior_output_ids=prior)
            else:
                target = decode_w
                work = protocol.DecodeLocalRequest(request_id=work_id, prompt_token_ids=prompt, sampling=params,
                                                   reply_to=inbox, cache_salt=req.cache_salt, deadline_s=deadline_s,
                                                   retention=req.retention, model_fingerprint=build,
                                                   router_id=self.router_id, router_instance=self.router_instance,
                                                   prior_output_ids=prior)
            await self._dispatch(target, work)
            finished = await self._relay(sub, stream, stream.attempt, failovers)
        finally:
            stream.attempt = None
            account.close()
            await sub.unsubscribe()
            if not finished:  # stop whatever the workers are still doing for this attempt
                await self.nc.publish(subjects.WORK_CANCEL,
                                      protocol.encode(protocol.CancelRequest(request_id=work_id)))

    async def _await_workers(self, stream: Stream, roles: tuple[str, ...]) -> None:
        """Wait (at most ``worker_wait_s`` and the stream's deadline) while a role in ``roles`` has no placeable
        worker but the table knows one that may come back (a heartbeat late on a loaded host, a restart), or this
        router has not listened for a whole heartbeat window yet (``worker_dead_after_s``: a worker started before
        it may not have beaten since): that costs the request a delay, not an ``unavailable``. Returns at once
        when each role has a worker, or none is known and the router has heard a whole window."""
        until = min(stream.deadline, time.monotonic() + self.worker_wait_s)

        def may_come(role: str) -> bool:
            fresh = time.monotonic() - self.listening_since < self.table.dead_after_s
            return self.table.known(role) or fresh
        while time.monotonic() < until and any(not self.table.placeable(r) and may_come(r) for r in roles):
            await asyncio.sleep(0.05)

    def prompt_holder(self, rid: str) -> dict[str, int]:
        """``{decode worker: prompt tokens}`` where stream ``rid`` decodes now (empty when it does not): that worker
        holds the prompt's KV before its KV events reach this router (another choice of the same prompt)."""
        stream = self.live.get(rid)
        attempt = stream.attempt if stream is not None else None
        if attempt is None or attempt.decode_w is None or not stream.delivered:
            return {}
        return {attempt.decode_w.report.worker_id: stream.prompt_len}

    async def probe(self, worker_id: str, work_id: str) -> bool | None:
        """Whether ``worker_id`` still holds ``work_id``; None when it did not answer in time."""
        try:
            reply = await self.nc.request(subjects.ctl(worker_id, "probe"),
                                          protocol.encode(protocol.RequestProbe(request_id=work_id)), timeout=1.0)
            return protocol.decode(reply.data, protocol.Ack).ok
        except Exception as err:  # timeout, no responders, an old worker: the heartbeat watch covers it
            logger.debug("probe of %s on %s failed: %r", work_id, worker_id, err)
            return None

    async def _dispatch(self, worker: WorkerState, work) -> None:
        """Send ``work`` to ``worker`` and wait for its Ack; a worker that does not accept is retryable."""
        wid = worker.report.worker_id
        subject = subjects.prefill(wid) if isinstance(work, protocol.PrefillRequest) else subjects.decode(wid)
        try:
            reply = await self.nc.request(subject, protocol.encode(work), timeout=self.dispatch_timeout_s,
                                          headers=tracing.headers())
        except Exception as err:  # timeout, no responders, connection loss
            raise AttemptFailed(ErrorCode.UNAVAILABLE, f"worker {wid} did not accept: {err!r}", {wid}) from None
        answer = protocol.decode(reply.data, (protocol.Ack, protocol.ErrorReply))
        if isinstance(answer, protocol.ErrorReply):
            err = answer.to_exception()
            if err.code.value in RETRYABLE_CODES:
                raise AttemptFailed(err.code, f"worker {wid} refused: {err.message}", {wid}, refused=True)
            raise err

    async def _relay(self, sub, stream: Stream, att: Attempt, failovers: int) -> bool:
        """Forward one attempt's chunks to the client until its final chunk; True when it ended without error.

        The attempt's workers number its chunks 0, 1, 2, ... (the prefill worker's first token is 0); a gap, or
        a silence in which no worker holds the request any more (its end was lost in transit, e.g. across a
        NATS restart), fails the attempt without blaming a worker, and so does a worker that stops
        heartbeating (that one is avoided): the stream continues from what the client already has."""
        expected, got_token = 0, False
        work_id = att.work_id
        report = att.decode_w.report   # the prompt's KV a hand-off moves: its staging takes longer the more it is
        kv_bytes = -(-stream.prompt_len // max(1, report.block_size)) * report.block_bytes
        watch = _StallWatch(self, work_id, self.stall_probe_s, transfer_timeout(_StallWatch.HANDOFF_LOST_S, kv_bytes))
        while True:
            remaining = stream.deadline - time.monotonic()
            if remaining <= 0:
                raise DeepinferError(ErrorCode.TIMEOUT, "request timed out")
            try:
                msg = await sub.next_msg(timeout=min(remaining, 0.5))
            except asyncio.TimeoutError:
                # the prefill worker matters until the decode worker's first chunk (seq 1): after its own first
                # token it still stages and hands off the KV
                watched = [att.decode_w] + ([att.prefill_w] if att.prefill_w is not None and expected <= 1 else [])
                for w in watched:
                    if not self.table.is_alive(w.report.worker_id):
                        raise AttemptFailed(ErrorCode.WORKER_LOST, f"worker {w.report.worker_id} stopped "
                                            "responding", {w.report.worker_id}) from None
                await watch.idle([w.report.worker_id for w in watched],
                                 handing_off=att.prefill_w is not None and expected == 1)
                continue
            watch.chunk()
            chunk = protocol.decode(msg.data, protocol.TokenChunk)
            if chunk.error is not None and chunk.error.get("code") in RETRYABLE_CODES:
                # partner lost, hand-off failed, handed back by a draining worker: another pair may serve it
                raise AttemptFailed(ErrorCode(chunk.error["code"]), chunk.error.get("message", ""), att.worker_ids)
            if chunk.error is None and chunk.seq != expected:
                raise AttemptFailed(ErrorCode.WORKER_LOST, f"chunk {expected} of {work_id} was lost in transit "
                                    f"(got {chunk.seq})", set())
            expected += 1
            att.decoding = expected >= (2 if att.prefill_w is not None else 1)
            if chunk.token_ids and not got_token:
                got_token = True
                att.account.prefill_done()
                if stream.ttft_s is None:
                    stream.ttft_s = time.monotonic() - stream.t0
                    tracing.event("first_token")
            usage = chunk.usage
            if chunk.final and usage is not None:  # the whole stream's usage, not this attempt's
                usage = stream.whole_usage(usage, len(stream.delivered) + len(chunk.token_ids), failovers)
            await self.forward(stream, dataclasses.replace(chunk, usage=usage))
            if chunk.final:
                return chunk.error is None

    async def forward(self, stream: Stream, chunk: protocol.TokenChunk) -> None:
        """Publish ``chunk`` to the client under the stream's id and next seq; remember delivered tokens."""
        out = dataclasses.replace(chunk, request_id=stream.rid, seq=stream.next_seq)
        await stream.send(out)
        stream.next_seq += 1
        stream.delivered.extend(chunk.token_ids)
        stream.ended = chunk.final
        if chunk.final:
            stream.usage = out.usage


class _StallWatch:
    """Probes the attempt's workers after ``every_s`` without a chunk. When every probed worker answers that it
    no longer holds the request, the attempt gets one more quiet interval (a final chunk published just before
    the answer is already queued for us); still nothing then means its end was lost in transit. During a
    hand-off (the prefill worker's first token is in, ``watched`` is [decode, prefill]), a decode worker that
    does not hold the request while the prefill worker still does, for ``HANDOFF_LOST_S``, never got the
    hand-off (a route not yet back after a link outage): the attempt fails over then, not after the prefill
    worker's whole hand-off timeout. The decode worker holds a hand-off from its arrival (during the fetch); the
    prefill worker stages the KV before it sends it, so the wait grows with the prompt's KV bytes (``lost_s``:
    ``transfer_timeout``; 32K tokens of Gemma 3's KV took more than the fixed 8 s to stage)."""

    HANDOFF_LOST_S = 8.0

    def __init__(self, relay: Relay, work_id: str, every_s: float, lost_s: float = HANDOFF_LOST_S) -> None:
        self.relay, self.work_id, self.every_s, self.lost_s = relay, work_id, every_s, lost_s
        self.next_probe = time.monotonic() + every_s
        self.orphaned = False
        self.unreceived_since: float | None = None

    def chunk(self) -> None:
        self.next_probe, self.orphaned, self.unreceived_since = time.monotonic() + self.every_s, False, None

    async def idle(self, worker_ids: list[str], handing_off: bool = False) -> None:
        if self.orphaned:
            raise AttemptFailed(ErrorCode.WORKER_LOST, f"the stream of {self.work_id} stalled and no worker holds "
                                "it: its end was lost in transit", set())
        now = time.monotonic()
        if now < self.next_probe:
            return
        self.next_probe = now + self.every_s
        held = [await self.relay.probe(wid, self.work_id) for wid in worker_ids]
        self.orphaned = all(h is False for h in held)
        if not (handing_off and held[0] is False and held[-1] is True):
            self.unreceived_since = None
        elif self.unreceived_since is None:
            self.unreceived_since = now
        elif now - self.unreceived_since >= self.lost_s:
            raise AttemptFailed(ErrorCode.TRANSFER_FAILED, f"the hand-off of {self.work_id} never reached "
                                f"{worker_ids[0]}", {worker_ids[0]})


def attempt_id(rid: str, placement: int) -> str:
    """The workers' id for placement ``placement`` of client request ``rid`` (unique, bounded length)."""
    suffix = f"~{placement}"
    return rid + suffix if len(rid) + len(suffix) <= MAX_ID_LEN else uuid.uuid4().hex + suffix
