"""Live migration of running streams between decode workers, router side.

``Migrator.migrate(rid, target="")`` moves the stream of client request ``rid`` (relayed by this router, its
decode worker streaming) to ``target`` or, when none is named, to the decode worker of the stream's model build
with the fewest running and placed requests. It asks the source on ``ctl(<source>, "migrate")`` with the KV
transport the pair shares (``choose_transport``, as for prefill hand-offs); the source detaches the sequence,
ships its KV, newest token, sampler state and next ``seq`` to the target and answers once the target runs it
(``services/decode/migration.py``). The attempt then watches the target (liveness, stall probes, errors) and
its inflight accounting moves; the client's stream goes on with gap-free ``seq`` and its final usage counts
``migrations``. A refused or failed migration leaves the stream where it was, decoding.

Operators (and tests) ask on ``ctl(<router>, "migrate")`` with a ``MigrateRequest`` (client request id, target
or ""); the reply is an ``Ack`` naming the target, or the error.

Invariants: one migration at a time per stream; ``max_inflight`` per router (more: ``overloaded``); the target is
alive, not draining, of the stream's build, not the source and not a worker the stream failed on; every wait is
bounded (``timeout_s``).
"""
from __future__ import annotations

import logging

from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode
from shared.sched.placement import choose_transport
from services.router.placement import worker_view
from services.router.relay import Relay, Stream
from services.router.workers import WorkerState, WorkerTable

logger = logging.getLogger(__name__)


class Migrator:
    def __init__(self, nc, relay: Relay, table: WorkerTable, timeout_s: float = 40.0, max_inflight: int = 8) -> None:
        self.nc, self.relay, self.table = nc, relay, table
        self.timeout_s, self.max_inflight = timeout_s, max_inflight
        self.inflight = 0
        self.done = self.failed = 0

    def _target(self, stream: Stream, source: str, named: str) -> WorkerState:
        candidates = [w for w in self.table.alive("decode")
                      if w.report.worker_id != source and w.report.worker_id not in stream.failed_workers
                      and (stream.fingerprint is None or w.report.model_fingerprint == stream.fingerprint)]
        if named:
            candidates = [w for w in candidates if w.report.worker_id == named]
        if not candidates:
            raise DeepinferError(ErrorCode.UNAVAILABLE, f"no decode worker to move {stream.rid} to"
                                 + (f" ({named!r} is not one)" if named else ""))
        return min(candidates, key=lambda w: (w.report.num_running + w.report.num_waiting + w.inflight,
                                              w.report.kv_usage))

    async def migrate(self, rid: str, target: str = "") -> str:
        """Move ``rid``'s stream to ``target`` (or the least loaded decode worker); returns the target's id."""
        stream = self.relay.live.get(rid)
        att = stream.attempt if stream is not None else None
        if att is None or not att.decoding:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"{rid!r} is not decoding on a worker of this router")
        if att.migrating or self.inflight >= self.max_inflight:
            raise DeepinferError(ErrorCode.OVERLOADED, f"{rid!r} is moving already, or {self.inflight} streams are")
        source = att.decode_w
        dest = self._target(stream, source.report.worker_id, target)
        transport = choose_transport(worker_view(source), worker_view(dest))
        if transport is None:
            raise DeepinferError(ErrorCode.UNAVAILABLE, f"{source.report.worker_id} and {dest.report.worker_id} "
                                 "share no KV transport")
        att.migrating, self.inflight = True, self.inflight + 1
        order = protocol.MigrateRequest(request_id=att.work_id, target=dest.report.worker_id, transport=transport)
        try:
            try:
                reply = await self.nc.request(subjects.ctl(source.report.worker_id, "migrate"),
                                              protocol.encode(order), timeout=self.timeout_s)
            except Exception as err:  # timeout, no responders (an old worker), connection loss
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"{source.report.worker_id} did not answer the "
                                     f"migration of {rid}: {err!r}") from None
            protocol.decode_reply(reply.data, protocol.Ack)
        except DeepinferError:
            self.failed += 1
            raise
        finally:
            att.migrating, self.inflight = False, self.inflight - 1
        if stream.attempt is att:  # the attempt may have ended (or failed over) meanwhile
            att.account.move(source, dest)
            att.decode_w = dest
        stream.migrations += 1
        self.done += 1
        logger.info("[%s] migrated %s -> %s over %s", rid, source.report.worker_id, dest.report.worker_id, transport)
        return dest.report.worker_id

    async def on_migrate(self, msg) -> None:
        """``ctl(<router>, "migrate")``: an operator's (or a test's) order for one client stream."""
        order = protocol.decode(msg.data, protocol.MigrateRequest)
        target = await self.migrate(order.request_id, order.target)
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(detail=target)))
