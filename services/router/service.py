"""Router: the NATS request API ``di.v1.generate``.

Per request: validate and tokenize; pick a decode worker and (unless the prompt is short or the client asked
for local prefill) a prefill worker and a KV transport; dispatch; relay the workers' token chunks to the
client's reply subject with one gap-free sequence numbering; enforce the request's timeout; when a worker
serving it stops heartbeating (or does not accept it), re-place the request with prompt + the tokens already
delivered, up to ``max_failovers`` times, so the client sees one stream with no gap or duplicate (greedy output
is exactly the uninterrupted one; a sampled continuation draws afresh from the same distribution), then fail
with ``worker_lost``; stop the workers when the client cancels
(``di.v1.cancel``) or the request ends early. Every reply on the client's subject is a ``TokenChunk``; the
last one has ``final=True`` and either usage or an error. Undecodable requests get an ``ErrorReply``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid

from shared import protocol, subjects
from shared.bus import ServiceRuntime, connect
from shared.config import RouterConfig
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.wire_fields import MAX_ID_LEN
from services.router.tokenize import load_tokenizer, prompt_token_ids
from services.router.placement import Placer
from services.router.workers import InflightAccount, WorkerTable, choose_transport
from shared.sched.kv_index import KVIndex
from shared.sched.profiles import get_profile

logger = logging.getLogger(__name__)


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.table = WorkerTable(config.worker_dead_after_s)
        self.index = KVIndex()
        self.placer = Placer(config.policy, self.table, self.index,
                             get_profile(config.profile).cost_model(config.block_size),
                             config.local_prefill_threshold, config.ttft_slo_s or None)
        self._resyncing: set[str] = set()
        self.tokenizer = None
        self.nc = None
        self.runtime: ServiceRuntime | None = None
        self.relays: dict[str, asyncio.Task] = {}
        self.next_seq: dict[str, int] = {}  # per in-flight request: the seq of the next chunk to the client

    async def start(self) -> None:
        c = self.config
        logger.info("starting %s with %s", c.worker_id, c)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, c.model or None)
        self.nc = await connect(c.nats_url, c.worker_id)
        await self.nc.subscribe(subjects.LOAD_ALL, cb=self.on_load)
        await self.nc.subscribe(subjects.KV_EVENTS, cb=self.on_kv_event)
        info = protocol.WorkerInfo(worker_id=c.worker_id, role="router", model_id="", host=socket.gethostname(),
                                   pid=os.getpid(), transports=[], block_size=0, started_at=time.time())
        self.runtime = ServiceRuntime(self.nc, info)
        await self.runtime.serve(subjects.GENERATE, self.on_generate, queue="routers")
        await self.runtime.serve(subjects.CANCEL, self.on_cancel)
        self.runtime.start_heartbeat(lambda: {"num_running": len(self.relays), "num_waiting": 0, "kv_usage": 0.0,
                                              "num_free_blocks": 0, "num_total_blocks": 0})

    async def on_load(self, msg) -> None:
        try:
            report = protocol.decode(msg.data, protocol.LoadReport)
        except DeepinferError as err:
            logger.warning("bad heartbeat: %s", err)
            return
        wid = report.worker_id
        last = self.index.last_seq(wid)
        prev = self.table.workers.get(wid)
        if last is not None and report.kv_event_seq < last:  # restarted under the same id: start over
            self.index.remove_worker(wid)
        elif (prev is not None and prev.report.kv_event_seq > (last or 0) and wid not in self._resyncing
              and self.table.is_alive(wid)):
            # the previous heartbeat announced events a whole heartbeat ago that never arrived (lost while the
            # worker went idle, or published before this router started): nothing else would ever notice
            asyncio.create_task(self._resync(wid))
        self.table.update(report)

    async def on_kv_event(self, msg) -> None:
        try:
            event = protocol.decode(msg.data, protocol.KVEvent)
        except DeepinferError as err:
            logger.warning("bad KV event: %s", err)
            return
        if not self.index.apply(event) and event.worker_id not in self._resyncing:
            asyncio.create_task(self._resync(event.worker_id))

    async def _resync(self, worker_id: str) -> None:
        """Replace a worker's index entries with its snapshot after a gap in its event sequence."""
        self._resyncing.add(worker_id)
        try:
            reply = await self.nc.request(subjects.ctl(worker_id, "kv_snapshot"), b"", timeout=2.0)
            snap = protocol.decode(reply.data, protocol.KVSnapshot)
            self.index.resync(worker_id, snap.seq, {"device": snap.block_hashes})
            logger.info("KV index resynced %s at seq %d (%d blocks)", worker_id, snap.seq, len(snap.block_hashes))
        except Exception as err:  # the worker stays flagged; its next event retries
            logger.warning("KV index resync of %s failed: %r", worker_id, err)
        finally:
            self._resyncing.discard(worker_id)

    async def on_cancel(self, msg) -> None:
        task = self.relays.get(protocol.decode(msg.data, protocol.CancelRequest).request_id)
        if task is not None:
            task.cancel()

    async def on_generate(self, msg) -> None:
        if not msg.reply:
            raise invalid("generate needs a reply subject (use a NATS request or an inbox)")
        req = protocol.decode(msg.data, protocol.GenerateRequest)  # errors → ErrorReply via the runtime
        rid = req.request_id or uuid.uuid4().hex
        if rid in self.relays:
            raise invalid(f"request id {rid!r} is already in flight")
        self.relays[rid] = asyncio.current_task()
        self.next_seq[rid] = 0
        try:
            await self._serve(req, rid, msg.reply)
        except (DeepinferError, asyncio.CancelledError) as exc:
            err = exc if isinstance(exc, DeepinferError) else DeepinferError(ErrorCode.CANCELLED, "cancelled")
            chunk = protocol.TokenChunk.from_error(rid, self.next_seq[rid], err)
            await self.nc.publish(msg.reply, protocol.encode(chunk))
        finally:
            self.relays.pop(rid, None)
            self.next_seq.pop(rid, None)

    def _check_model(self, model: str) -> None:
        served = {s.report.model_id for s in self.table.workers.values() if s.report.model_id}
        if model and model not in served and model != "default":
            raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} is not served here "
                                 f"(serving: {sorted(served) or 'nothing yet'})")

    async def _serve(self, req: protocol.GenerateRequest, rid: str, client: str) -> None:
        if len(self.relays) > self.config.max_inflight:
            raise DeepinferError(ErrorCode.OVERLOADED, f"more than {self.config.max_inflight} requests in flight")
        self._check_model(req.model)
        req.sampling_params()  # invalid sampling fails here, before any placement
        prompt = prompt_token_ids(self.tokenizer, req)
        stream = _Stream(rid, client, len(prompt), time.monotonic() + req.timeout_s)
        attempt = 0
        while True:
            try:
                await self._attempt(req, prompt, stream, attempt)
                return
            except DeepinferError as err:
                # failover (DESIGN step 5): a worker that died, or did not accept, is replaced by another one
                # that continues from prompt + the tokens already delivered; the client sees one stream
                retry = (err.code.value in _FAILOVER_CODES or isinstance(err, _NotAccepted)) and not stream.ended
                if not retry or attempt >= self.config.max_failovers or stream.deadline <= time.monotonic():
                    raise
                attempt += 1
                stream.failed_workers.update(err.workers if isinstance(err, _AttemptFailed) else ())
                logger.warning("%s: %s; re-placing with %d tokens delivered (failover %d)", rid, err.message,
                               len(stream.delivered), attempt)

    async def _attempt(self, req: protocol.GenerateRequest, prompt: list[int], stream: _Stream,
                       attempt: int) -> None:
        """Place and run the request once, continuing after the tokens ``stream`` already delivered."""
        rid = stream.rid
        params = req.sampling_params()
        if stream.delivered:
            left = params.max_tokens - len(stream.delivered)
            if left <= 0:  # the worker died between the last token and the final chunk
                await self._forward(stream, protocol.TokenChunk(
                    request_id=rid, seq=0, token_ids=[], final=True, finish_reason="length",
                    usage={"prompt_tokens": stream.prompt_len, "completion_tokens": len(stream.delivered),
                           "ttft_ms": (stream.ttft_s or 0.0) * 1000.0, "failovers": attempt}))
                return
            params = dataclasses.replace(params, max_tokens=left,
                                         min_tokens=max(0, params.min_tokens - len(stream.delivered)))
            prompt = prompt + stream.delivered
        # workers see their own id per attempt: the router's cancel of a dead attempt (on di.v1.cancel, which
        # the router itself listens to for clients) must not cancel the client's request
        work_id = _attempt_id(rid, attempt)
        prefill_w, decode_w = self.placer.place(work_id, prompt, params.max_tokens, req.cache_salt,
                                                req.prefill_mode, exclude=stream.failed_workers)
        transport = None
        if prefill_w is not None:
            transport = choose_transport(prefill_w.report, decode_w.report, req.transport)
            if transport is None and (req.prefill_mode == "remote" or req.transport):
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"no common KV transport ({req.transport or 'any'}) "
                                     f"between {prefill_w.report.worker_id} and {decode_w.report.worker_id}")
            if transport is None:
                prefill_w = None
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, pending_msgs_limit=params.max_tokens + 16)
        account = InflightAccount(prefill_w, decode_w, len(prompt))
        finished = False
        try:
            sampling = protocol.sampling_to_dict(params)
            if prefill_w is not None:
                target = subjects.prefill(prefill_w.report.worker_id)
                work = protocol.PrefillRequest(request_id=work_id, prompt_token_ids=prompt, sampling=sampling,
                                               decode_worker=decode_w.report.worker_id, transport=transport,
                                               reply_to=inbox, cache_salt=req.cache_salt,
                                               deadline_s=stream.deadline - time.monotonic())
            else:
                target = subjects.decode(decode_w.report.worker_id)
                work = protocol.DecodeLocalRequest(request_id=work_id, prompt_token_ids=prompt, sampling=sampling,
                                                   reply_to=inbox, cache_salt=req.cache_salt)
            try:
                await self._dispatch(target, work)
            except _NotAccepted as err:
                raise _AttemptFailed(err.code, err.message, {(prefill_w or decode_w).report.worker_id}) from None
            finished = await self._relay(sub, stream, prefill_w, decode_w, account.prefill_done, attempt)
        finally:
            account.close()
            await sub.unsubscribe()
            if not finished:  # stop whatever the workers are still doing for this attempt
                await self.nc.publish(subjects.CANCEL, protocol.encode(protocol.CancelRequest(request_id=work_id)))

    async def _dispatch(self, subject: str, work) -> None:
        try:
            reply = await self.nc.request(subject, protocol.encode(work), timeout=self.config.dispatch_timeout_s)
        except Exception as err:  # timeout, no responders
            raise _NotAccepted(ErrorCode.UNAVAILABLE, f"worker on {subject} did not accept: {err!r}") from None
        answer = protocol.decode(reply.data, (protocol.Ack, protocol.ErrorReply))
        if isinstance(answer, protocol.ErrorReply):
            raise answer.to_exception()

    async def _relay(self, sub, stream: _Stream, prefill_w, decode_w, on_first_token, attempt: int) -> bool:
        """Forward one attempt's chunks to the client until its final chunk; True when it ended without error.
        Raises ``worker_lost`` when a worker this attempt still depends on stops heartbeating."""
        chunks, got_token = 0, False
        while True:
            remaining = stream.deadline - time.monotonic()
            if remaining <= 0:
                raise DeepinferError(ErrorCode.TIMEOUT, "request timed out")
            try:
                msg = await sub.next_msg(timeout=min(remaining, 0.5))
            except asyncio.TimeoutError:
                # the prefill worker matters until the decode worker's first chunk: after its own first token it
                # still stages and hands off the KV
                watched = [decode_w] + ([prefill_w] if prefill_w is not None and chunks <= 1 else [])
                for w in watched:
                    if not self.table.is_alive(w.report.worker_id):
                        raise _AttemptFailed(ErrorCode.WORKER_LOST, f"worker {w.report.worker_id} stopped "
                                             "responding", {w.report.worker_id}) from None
                continue
            chunk = protocol.decode(msg.data, protocol.TokenChunk)
            chunks += 1
            if chunk.token_ids and not got_token:
                got_token = True
                on_first_token()
                if stream.ttft_s is None:
                    stream.ttft_s = time.monotonic() - stream.t0
            if chunk.error is not None and chunk.error.get("code") in _FAILOVER_CODES:
                # a worker reports its partner lost or the KV transfer failed: another pair may serve it
                raise _AttemptFailed(ErrorCode(chunk.error["code"]), chunk.error.get("message", ""),
                                     {w.report.worker_id for w in (prefill_w, decode_w) if w is not None})
            usage = chunk.usage
            if chunk.final and usage is not None:  # the whole stream's usage, not this attempt's
                usage = {**usage, "prompt_tokens": stream.prompt_len,
                         "completion_tokens": len(stream.delivered) + len(chunk.token_ids),
                         "ttft_ms": (stream.ttft_s or 0.0) * 1000.0, "failovers": attempt}
            await self._forward(stream, dataclasses.replace(chunk, usage=usage))
            if chunk.final:
                return chunk.error is None

    async def _forward(self, stream: _Stream, chunk: protocol.TokenChunk) -> None:
        """Publish ``chunk`` to the client under the stream's id and next seq; remember delivered tokens."""
        out = dataclasses.replace(chunk, request_id=stream.rid, seq=self.next_seq[stream.rid])
        await self.nc.publish(stream.client, protocol.encode(out))
        self.next_seq[stream.rid] += 1
        stream.delivered.extend(chunk.token_ids)
        stream.ended = chunk.final

    async def run_forever(self) -> None:
        await self.start()
        self.runtime.install_signal_handlers()
        await self.runtime.stopped.wait()


_FAILOVER_CODES = frozenset({ErrorCode.WORKER_LOST.value, ErrorCode.TRANSFER_FAILED.value})


class _NotAccepted(DeepinferError):
    """A worker did not acknowledge a dispatch in time (dead or stuck): the request may go elsewhere."""


class _AttemptFailed(DeepinferError):
    """An attempt failed because of ``workers`` (dead, not accepting, or a failed hand-off between them)."""

    def __init__(self, code: ErrorCode, message: str, workers: set[str]) -> None:
        super().__init__(code, message)
        self.workers = workers


@dataclasses.dataclass(slots=True)
class _Stream:
    """One client stream across failover attempts: what the client has received so far."""
    rid: str
    client: str
    prompt_len: int
    deadline: float
    t0: float = dataclasses.field(default_factory=time.monotonic)
    ttft_s: float | None = None
    delivered: list[int] = dataclasses.field(default_factory=list)
    ended: bool = False
    failed_workers: set[str] = dataclasses.field(default_factory=set)  # not placed on again by this stream


def _attempt_id(rid: str, attempt: int) -> str:
    """The workers' id for failover attempt ``attempt`` of client request ``rid`` (unique, bounded length)."""
    suffix = f"~{attempt}"
    return rid + suffix if len(rid) + len(suffix) <= MAX_ID_LEN else uuid.uuid4().hex + suffix
