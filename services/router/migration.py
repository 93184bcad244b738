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
or ""); the reply is an ``Ack`` naming the target, or the error. ``consider`` runs the policy
(``services/router/policy/migration_policy.py``: drain, KV pressure, TPOT, room for the urgent, skew) on every decode heartbeat, at most every
``CONSIDER_EVERY_S``, and carries out its moves in the background.

Invariants: one migration at a time per stream; ``max_inflight`` per router (more: ``overloaded``); the target is
alive, not draining, of the stream's build, not the source and not a worker the stream failed on; every wait is
bounded (``timeout_s``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode
from services.router.policy.migration_policy import DecodeLoad, MigrationConfig, MovableStream, choose_moves
from services.router.policy.placement import choose_transport
from services.router.placement import worker_view
from services.router.relay import Relay, Stream
from services.router.workers import WorkerState, WorkerTable

logger = logging.getLogger(__name__)

CONSIDER_EVERY_S = 0.25


class Migrator:
    """``policy`` None: only operators' orders; ``spawn`` runs the policy's moves as tracked tasks. ``timeout_s``
    outlasts a worker's worst case (a pre-copy and a switch, each within its 30 s hand-off timeout)."""

    def __init__(self, nc, relay: Relay, table: WorkerTable, timeout_s: float = 75.0, max_inflight: int = 8,
                 policy: MigrationConfig | None = None, on_drain: bool = True,
                 spawn: Callable = lambda coro: None) -> None:
        self.nc, self.relay, self.table = nc, relay, table
        self.timeout_s, self.max_inflight = timeout_s, max_inflight
        self.policy, self.on_drain, self.spawn = policy, on_drain, spawn
        self.inflight = 0
        self.by_source: dict[str, int] = {}  # moves under way per source worker
        self.done = self.failed = 0
        self.reasons: dict[str, int] = {}  # moves the policy started, by reason
        self._considered = 0.0

    @classmethod
    def for_router(cls, nc, relay: Relay, table: WorkerTable, config, spawn: Callable) -> "Migrator":
        """The router's migrator, its policy from ``RouterConfig``."""
        policy = MigrationConfig(kv_high=config.migrate_kv_high, kv_low=config.migrate_kv_low,
                                 cooldown_s=config.migrate_cooldown_s, skew_min=config.migrate_skew_min,
                                 skew_ratio=config.migrate_skew_ratio, tpot_slo_s=config.migrate_tpot_slo_s,
                                 urgent=config.migrate_for_urgent)
        return cls(nc, relay, table, policy=policy, on_drain=config.migrate_on_drain, spawn=spawn)

    def consider(self, now: float | None = None) -> list[tuple[str, str, str]]:
        """Run the policy on the current heartbeats and streams; start its moves (returned)."""
        now = time.monotonic() if now is None else now
        if (self.policy is None and not self.on_drain) or now - self._considered < CONSIDER_EVERY_S:
            return []
        self._considered = now
        cfg = self.policy or MigrationConfig(kv_high=2.0, skew_min=0, urgent=False)  # drain only
        # placed requests (``inflight``) include the running ones the heartbeat counts: the larger of the two
        workers = [DecodeLoad(w.report.worker_id, max(w.report.num_running + w.report.num_waiting, w.inflight),
                              w.report.kv_usage,
                              w.report.draining and self.on_drain, w.report.step_ms / 1000.0,
                              w.report.max_num_seqs)
                   for w in self.table.workers.values()
                   if w.report.role == "decode" and self.table.is_alive(w.report.worker_id)]
        streams, urgent = [], {}
        for rid, s in self.relay.live.items():
            if s.attempt is None:
                continue
            wid = s.attempt.decode_w.report.worker_id
            if s.attempt.decoding:
                streams.append(MovableStream(rid, wid, s.prompt_len + len(s.delivered),
                                             s.max_tokens - len(s.delivered), s.moved_at, s.attempt.migrating,
                                             s.priority))
            else:   # placed, not started: what a full worker should make room for
                urgent[wid] = min(urgent.get(wid, s.priority), s.priority)
        moves = choose_moves(cfg, now, workers, streams, self.by_source, urgent if cfg.urgent else None)
        for rid, target, reason in moves:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
            self.spawn(self._move(rid, target, reason))
        return moves

    async def _move(self, rid: str, target: str, reason: str) -> None:
        try:
            await self.migrate(rid, target)
        except DeepinferError as err:  # the stream ended, the target went, the source refused: it stays put
            logger.info("[%s] %s migration to %s not made: %s", rid, reason, target, err)

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
        src_id = source.report.worker_id
        att.migrating, self.inflight = True, self.inflight + 1
        self.by_source[src_id] = self.by_source.get(src_id, 0) + 1
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
            self.by_source[src_id] -= 1
            if not self.by_source[src_id]:
                del self.by_source[src_id]
        if stream.attempt is att:  # the attempt may have ended (or failed over) meanwhile
            att.account.move(source, dest)
            att.decode_w = dest
        stream.migrations, stream.moved_at = stream.migrations + 1, time.monotonic()
        stream.span.add_event("migrated", {"deepinfer.source": source.report.worker_id,
                                           "deepinfer.target": dest.report.worker_id, "deepinfer.transport": transport})
        self.done += 1
        logger.info("[%s] migrated %s -> %s over %s", rid, source.report.worker_id, dest.report.worker_id, transport)
        return dest.report.worker_id

    async def on_migrate(self, msg) -> None:
        """``ctl(<router>, "migrate")``: an operator's (or a test's) order for one client stream."""
        order = protocol.decode(msg.data, protocol.MigrateRequest)
        target = await self.migrate(order.request_id, order.target)
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(detail=target)))
