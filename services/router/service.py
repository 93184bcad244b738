"""Router: the NATS request API ``di.v1.generate`` (and ``di.v1.generate.<tenant>``) and, through the same
``serve`` path, the OpenAI-compatible HTTP API (``services/router/http_api.py``) with ``GET /metrics``.

Validates and tokenizes each request, admits it (at most ``max_inflight`` concurrent streams; the policy
rejects with ``overloaded`` when the predicted TTFT misses ``ttft_slo_s``), and serves it through ``Relay``
(placement, dispatch, relay, failover: ``services/router/relay.py``). Keeps the worker table (heartbeats on
``di.v1.*.*.load``) and the KV index (``di.v1.kv.*.events``, resynced from a worker's snapshot after a gap) and
prunes both: a worker silent past the table's ``forget_after_s`` is dropped, and index entries of workers
that are dead or never heartbeated are dropped after a sweep interval. Every reply on the client's subject is a
``TokenChunk``; the last one has ``final=True`` and either usage or an error. Undecodable requests get an
``ErrorReply``. A client cancel (``di.v1.cancel``) stops the stream and its workers; a tenant's cancel
(``di.v1.cancel.<tenant>``) stops only that tenant's streams. An authenticated tenant's requests run under the
cache salt ``t/<tenant>`` (``services/router/tenancy.py``), a prefix nobody else may claim.

Drain (SIGTERM): leave the ``routers`` queue group (other routers take new requests), let relayed streams
finish for ``drain_grace_s``, end the rest with ``unavailable``, then drain NATS.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from pathlib import Path

from shared.model.locate import served_model_name
from shared.host_identity import host_id
from shared import protocol, subjects, tracing
from shared.bus import Service, ServiceRuntime, connect
from shared.accounting import Ledger, Prices
from services.router.config import RouterConfig, parse_weights
from shared.retention import RetentionPolicy
from shared.errors import DeepinferError, ErrorCode, invalid
from services.router.http_api import HttpApi
from services.router.metrics import RouterMetrics
from services.router.ledger_metrics import RouterCollector
from services.router.placement import Placer
from services.router.migration import Migrator
from services.router.planner import RouterPlanner
from services.router.stats import router_stats
from services.router.relay import Relay, Stream
from services.router.choices import serve_choices
from services.router.tokenize import load_tokenizer, prompt_token_ids
from services.router.fair_gate import FairGate, Shed, TenantLimit
from shared.sampling import MAX_PRIORITY
from shared.slo_classes import SloClasses, parse_tenant_classes
from services.router.tenancy import tenant_salt
from services.router.workers import WorkerTable
from services.router.policy.kv_index import KVIndex
from services.router.policy.profiles import get_profile

logger = logging.getLogger(__name__)

THREAD_TOKENIZE_CHARS = 8192  # prompts longer than this are tokenized off the event loop


class RouterService(Service):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.table = WorkerTable(config.worker_dead_after_s)
        self.index = KVIndex()
        self.placer = Placer(config.policy, self.table, self.index,
                             get_profile(config.profile).cost_model(config.block_size),
                             config.local_prefill_threshold)
        self._resyncing: set[str] = set()
        self._unknown_in_index: set[str] = set()  # index workers with no table entry at the last sweep
        self.tokenizer = None
        self.started_at = int(time.time())   # GET /v1/models' ``created``
        self.served_name = config.served_model_name or served_model_name(config.model or None)
        self.nc = None
        self.runtime: ServiceRuntime | None = None
        self.relay: Relay | None = None
        self.migrator: Migrator | None = None
        self.planner: RouterPlanner | None = None  # the online P:D planner (``planner`` on)
        self.relays: dict[str, asyncio.Task] = {}  # client request id -> the task serving it
        self.owners: dict[str, tuple[str, str | None]] = {}  # client request id -> (its API, its tenant or None)
        self.http: HttpApi | None = None
        self._draining = False
        self.retention_classes = frozenset(RetentionPolicy.from_spec(config.retention).ttl_s)
        self.slo = SloClasses.from_spec(config.slo_classes, config.default_slo_class, config.ttft_slo_s)
        self.tenant_classes = parse_tenant_classes(config.tenant_classes)
        self.metrics = RouterMetrics(table=self.table)
        self.gate = FairGate(self._dispatch_window, config.tenant_max_inflight or max(1, config.max_inflight // 2),
                             parse_weights(config.tenant_weights))
        self.ledger = Ledger(Prices(cached_per_mtok=config.price_cached, uncached_per_mtok=config.price_uncached))

    async def start(self) -> None:
        c = self.config
        logger.info("starting %s with %s", c.worker_id, c)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, c.model or None)
        if c.chat_template:   # --chat-template: the deployment's template instead of the model's
            self.tokenizer.chat_template = Path(c.chat_template).read_text(encoding="utf-8")
        self.nc = await connect(c.nats_url, c.worker_id, on_closed=self._on_nats_closed, user=c.nats_user,
                                password=c.nats_password, on_reconnected=self.table.router_reconnected)
        info = protocol.WorkerInfo(worker_id=c.worker_id, role="router", model_id="", host=host_id(c.host_id),
                                   pid=os.getpid(), transports=[], block_size=0, started_at=time.time())
        self.runtime = ServiceRuntime(self.nc, info, registry_replicas=c.registry_replicas)
        self.relay = Relay(self.nc, self.placer, self.table, c.dispatch_timeout_s, c.max_failovers, c.stall_probe_s,
                           on_failover=self.metrics.failover, router=(c.worker_id, self.runtime.instance),
                           max_refusals=c.max_refusals, worker_wait_s=c.worker_wait_s)
        self.migrator = Migrator.for_router(self.nc, self.relay, self.table, c, self.runtime.spawn)
        self.metrics.registry.register(RouterCollector(self))
        await self.runtime.serve(subjects.LOAD_ALL, self.on_load, work=False)
        await self.runtime.serve(subjects.KV_EVENTS, self.on_kv_event, work=False)
        await self.runtime.serve(subjects.GENERATE, self.on_generate, queue="routers")
        await self.runtime.serve(subjects.GENERATE_TENANTS, self.on_generate, queue="routers")
        await self.runtime.serve(subjects.CANCEL, self.on_cancel, work=False)
        await self.runtime.serve(subjects.CANCEL_TENANTS, self.on_cancel, work=False)
        await self.runtime.serve(subjects.HELD, self.on_held, work=False)
        await self.runtime.serve(subjects.HELD_TENANTS, self.on_held, work=False)
        await self.runtime.serve(subjects.stats(c.worker_id), self.on_stats, work=False)
        await self.runtime.serve(subjects.ctl(c.worker_id, "migrate"), self.migrator.on_migrate, work=False)
        self.runtime.start_heartbeat(lambda: {"num_running": len(self.relays), "num_waiting": 0, "kv_usage": 0.0,
                                              "num_free_blocks": 0, "num_total_blocks": 0})
        self.runtime.spawn(self._sweep_loop())
        self.planner = RouterPlanner.for_router(self.nc, self.table, c, self.placer.cost, self.metrics.registry,
                                                self.runtime.spawn)
        if self.planner is not None:
            self.planner.targets = self.live_class_targets
            self.runtime.spawn(self.planner.run())
        if c.http_port >= 0:
            self.http = HttpApi(self)
            await self.http.start(c.http_host, c.http_port)

    # ---- cluster state -------------------------------------------------------------------------------
    async def on_load(self, msg) -> None:
        report = protocol.decode(msg.data, protocol.LoadReport)
        if subjects.load_origin(msg.subject) != (report.role, report.worker_id):
            # the subject's role is bound to the sender's credential: a body claiming another role or id lies
            self.metrics.rejected("spoofed_heartbeat")
            logger.warning("heartbeat on %s claims %s %s: ignored", msg.subject, report.role, report.worker_id)
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
            self._start_resync(wid)
        self.table.update(report)
        if report.role == "decode":
            self.migrator.consider()

    async def on_kv_event(self, msg) -> None:
        event = protocol.decode(msg.data, protocol.KVEvent)
        if subjects.kv_events_origin(msg.subject) != event.worker_id:  # bound to the sender's credential
            self.metrics.rejected("spoofed_kv_event")
            logger.warning("KV event on %s claims %s: ignored", msg.subject, event.worker_id)
            return
        if not self.index.apply(event):
            self._start_resync(event.worker_id)

    def _start_resync(self, worker_id: str) -> None:
        if worker_id not in self._resyncing:
            self._resyncing.add(worker_id)
            self.runtime.spawn(self._resync(worker_id))

    async def _resync(self, worker_id: str) -> None:
        """Replace a worker's index entries with its snapshot after a gap in its event sequence."""
        try:
            reply = await self.nc.request(subjects.ctl(worker_id, "kv_snapshot"), b"", timeout=2.0)
            snap = protocol.decode(reply.data, protocol.KVSnapshot)
            self.index.resync(worker_id, snap.seq, {snap.tier: snap.block_hashes})
            logger.info("KV index resynced %s at seq %d (%d blocks)", worker_id, snap.seq, len(snap.block_hashes))
        except Exception as err:  # the worker stays flagged; its next event retries
            logger.warning("KV index resync of %s failed: %r", worker_id, err)
        finally:
            self._resyncing.discard(worker_id)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.worker_dead_after_s / 2))
            self.sweep()

    def sweep(self) -> None:
        """Bound the router's state: forget long-dead workers, drop index entries of dead workers, and of
        workers known only from KV events (no heartbeat) for a whole sweep interval."""
        for wid in self.table.prune():
            self.index.remove_worker(wid)
        known = set(self.index.worker_ids())
        for wid in known & set(self.table.workers):
            if not self.table.is_alive(wid):
                self.index.remove_worker(wid)
        unknown = known - set(self.table.workers)
        for wid in unknown & self._unknown_in_index:
            self.index.remove_worker(wid)
        self._unknown_in_index = unknown - self._unknown_in_index

    # ---- requests ------------------------------------------------------------------------------------
    async def on_cancel(self, msg) -> None:
        """A cancel stops a request of the same namespace only: a tenant's subject cancels that tenant's
        requests, the plain subject those that came without a tenant."""
        rid = protocol.decode(msg.data, protocol.CancelRequest).request_id
        if self._asked_by_owner(rid, msg.subject):
            self.relays[rid].cancel()

    async def on_held(self, msg) -> None:
        """A client asks whether its request is still relayed (``shared/client.py`` resumes it elsewhere when no
        router says so). Only the router holding it, in the asker's namespace, answers; the others stay silent."""
        rid = protocol.decode(msg.data, protocol.RequestProbe).request_id
        if msg.reply and self._asked_by_owner(rid, msg.subject):
            await msg.respond(protocol.encode(protocol.Ack(ok=True)))

    def _asked_by_owner(self, rid: str, subject: str) -> bool:
        """``rid`` is relayed here and came over NATS in the namespace (plain or tenant) of ``subject``."""
        return rid in self.relays and self.owners.get(rid) == ("nats", subjects.tenant_of(subject))

    async def on_generate(self, msg) -> None:
        if not msg.reply:
            raise invalid("generate needs a reply subject (use a NATS request or an inbox)")
        req = protocol.decode(msg.data, protocol.GenerateRequest)  # errors → ErrorReply via the runtime
        reply = msg.reply

        async def send(chunk: protocol.TokenChunk) -> None:
            await self.nc.publish(reply, protocol.encode(chunk))
        await self.serve(req, send, tenant=subjects.tenant_of(msg.subject), api="nats",
                         trace_parent=tracing.context_of(msg.headers))

    async def serve(self, req: protocol.GenerateRequest, send, tenant: str | None = None, api: str = "nats",
                    holders: dict[str, int] | None = None, trace_parent=None) -> None:
        """Serve one client request (NATS or HTTP): every chunk goes to ``send``, the last one is final (usage or
        an error). ``tenant`` is the authenticated tenant (its subject or API key), None for the plain API.
        Raises only ``invalid_request`` for a duplicate request id (before anything is sent). ``holders``:
        ``{worker: prompt tokens}`` known to hold the prompt's KV (another choice's: ``services/router/choices.py``).
        ``trace_parent``: the caller's trace context (``tracing.context_of`` its headers), the request span's
        parent."""
        with tracing.span("request", trace_parent, {"deepinfer.api": api, "deepinfer.request_id": req.request_id,
                                                    "deepinfer.choices": req.n}, server=True) as span:
            await self._serve(req, send, tenant, api, holders, span)

    async def _serve(self, req: protocol.GenerateRequest, send, tenant: str | None, api: str,
                     holders: dict[str, int] | None, span) -> None:
        rid = req.request_id or uuid.uuid4().hex
        if rid in self.relays:
            raise invalid(f"request id {rid!r} is already in flight")
        if req.n > 1:   # the parent is held under its id (cancel, held probes); each choice is a stream of its own
            self.relays[rid], self.owners[rid] = asyncio.current_task(), (api, tenant)
            try:
                return await serve_choices(self, dataclasses.replace(req, request_id=rid), send, tenant, api)
            finally:
                self.relays.pop(rid, None)
                self.owners.pop(rid, None)
        try:
            klass = self.slo.resolve(req.slo_class, req.service_tier, self.tenant_classes.get(tenant or "", ""))
        except DeepinferError as err:
            await send(protocol.TokenChunk.from_error(rid, 0, err))
            return
        req = dataclasses.replace(req, slo_class=klass.name, priority=max(-MAX_PRIORITY, min(
            MAX_PRIORITY, req.priority + klass.priority)))
        if len(self.relays) >= self.config.max_inflight and not self.gate.shed_for(req.priority):
            self.metrics.rejected("max_inflight")
            await send(protocol.TokenChunk.from_error(rid, 0, DeepinferError(
                ErrorCode.OVERLOADED, f"more than {self.config.max_inflight} requests in flight")))
            return
        self.relays[rid] = asyncio.current_task()
        self.owners[rid] = (api, tenant)
        stream = Stream(rid, send, 0, time.monotonic() + (req.timeout_s or protocol.MAX_REQUEST_S),
                        next_seq=req.resume_seq, delivered=list(req.resume_tokens), resumed=bool(req.resume_tokens),
                        holders=dict(holders or {}), slo_class=klass.name, ttft_target_s=self.slo.refusal_target(klass),
                        priority=req.priority, span=span)
        self.metrics.request_started(api)
        outcome = "finished"
        try:
            self._check_model(req.model)
            req = dataclasses.replace(req, retention=self._retention(req), cache_salt=tenant_salt(req, tenant))
            stream.retention = req.retention
            prompt = await self.tokenize(req)
            self._check_context(len(prompt))
            stream.prompt_len = len(prompt)
            waited = time.time_ns()
            async with self.gate.slot(tenant or "", stream.deadline, req.priority):
                tracing.record("gate", waited, time.time_ns(), {"deepinfer.priority": req.priority})
                await self.relay.serve(req, prompt, stream)
            self._account(req, stream, tenant)
        except (DeepinferError, asyncio.CancelledError) as exc:
            err = exc if isinstance(exc, DeepinferError) else (
                DeepinferError(ErrorCode.UNAVAILABLE, "router shutting down; retry") if self._draining
                else DeepinferError(ErrorCode.CANCELLED, "cancelled"))
            outcome = err.code.value
            if err.code == ErrorCode.OVERLOADED:
                self.metrics.rejected("tenant_limit" if isinstance(err, TenantLimit) else
                                      "shed" if isinstance(err, Shed) else "predicted_ttft")
            await send(protocol.TokenChunk.from_error(rid, stream.next_seq, err))
        finally:
            self.relays.pop(rid, None)
            self.owners.pop(rid, None)
            usage = stream.usage or {}
            tpot = usage.get("tpot_ms")
            self.metrics.request_finished(api, outcome, stream.ttft_s, tpot / 1000.0 if tpot else None,
                                          time.monotonic() - stream.t0, stream.usage)
            if outcome == "finished":
                self.metrics.class_finished(klass.name, stream.ttft_s, tpot / 1000.0 if tpot else None, klass.ttft_s,
                                            klass.tpot_s)
            span.set_attributes({"deepinfer.outcome": outcome, "deepinfer.slo_class": klass.name,
                                 "deepinfer.prompt_tokens": stream.prompt_len,
                                 "deepinfer.cached_tokens": int(usage.get("cached_tokens", 0) or 0),
                                 "deepinfer.tier_cached_tokens": int(usage.get("tier_cached_tokens", 0) or 0),
                                 "deepinfer.completion_tokens": int(usage.get("completion_tokens", 0) or 0),
                                 "deepinfer.ttft_ms": (stream.ttft_s or 0.0) * 1000.0,
                                 "deepinfer.failovers": int(usage.get("failovers", 0) or 0)})

    def live_class_targets(self) -> tuple[float, float]:
        """The tightest TTFT and TPOT targets (0: none) among the SLO classes of the streams relayed now."""
        live = {s.slo_class for s in self.relay.live.values()} if self.relay is not None else set()
        classes = [self.slo.classes[c] for c in live if c in self.slo.classes]
        return (min((c.ttft_s for c in classes if c.ttft_s), default=0.0),
                min((c.tpot_s for c in classes if c.tpot_s), default=0.0))

    def _retention(self, req: protocol.GenerateRequest) -> str:
        """The request's retention class: its own, else the deployment's default for its API."""
        name = req.retention or (self.config.chat_retention if req.messages is not None
                                 else self.config.prompt_retention)
        if name not in self.retention_classes:
            raise invalid(f"unknown retention class {name!r} (known: {sorted(self.retention_classes)})")
        return name

    def _account(self, req: protocol.GenerateRequest, stream: Stream, tenant: str | None) -> None:
        """One ledger line per tenant (the plain API's requests, whatever their salt, under ``default``), so
        clients varying ``cache_salt`` cannot crowd other tenants' lines out of the bounded ledger."""
        usage = stream.usage or {}
        prompt = int(usage.get("prompt_tokens", stream.prompt_len))
        tier = int(usage.get("tier_cached_tokens", 0) or 0)
        self.ledger.record(tenant or "", req.retention, prompt, int(usage.get("cached_tokens", 0) or 0),
                           int(usage.get("completion_tokens", 0) or 0), {"cache_tier": tier} if tier else None)

    async def on_stats(self, msg) -> None:
        """Reply with the accounting ledger (per tenant and class) and the router's counters."""
        if not msg.reply:
            return
        stats = router_stats(self)
        await msg.respond(protocol.encode(protocol.StatsReply(worker_id=self.config.worker_id, role="router",
                                                              stats=stats)))

    async def tokenize(self, req: protocol.GenerateRequest) -> list[int]:
        """The request's prompt token ids (chat template applied); long prompts off the event loop."""
        size = len(req.prompt or "") + sum(len(m.get("content", "")) for m in req.messages or ())
        if size > THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(prompt_token_ids, self.tokenizer, req)
        return prompt_token_ids(self.tokenizer, req)

    def _check_model(self, model: str) -> None:
        """A request names the served model id, or the model id its workers report (e.g. a GGUF's
        ``general.name``), or ``default``, or nothing."""
        reported = {s.report.model_id for s in self.table.workers.values() if s.report.model_id}
        if model and model not in reported and model not in (self.served_name, "default"):
            raise DeepinferError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} is not served here "
                                 f"(serving: {self.served_name if reported else 'nothing yet'})")

    def _dispatch_window(self) -> int | None:
        """Requests the workers take at once (``FairGate``): the configured window, else the alive decode
        workers' batch capacity; None = no limit (configured -1, or no decode worker reports one)."""
        if self.config.dispatch_window:
            return None if self.config.dispatch_window < 0 else self.config.dispatch_window
        return sum(s.report.max_num_seqs for s in self.table.alive("decode")) or None

    def _check_context(self, prompt_len: int) -> None:
        """At the door, before any hashing or placement: a prompt that fills the context window of every decode
        worker's engine (``max_model_len`` in their heartbeats) can never be served (``prompt_too_long``, 400)."""
        windows = [s.report.max_model_len for s in self.table.alive("decode") if s.report.max_model_len]
        if windows and prompt_len >= max(windows):
            raise DeepinferError(ErrorCode.PROMPT_TOO_LONG, f"prompt has {prompt_len} tokens; the context window "
                                 f"is {max(windows)}")

    # ---- what the HTTP API shows --------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self.runtime is not None and self.runtime.draining

    def ready_workers(self) -> dict[str, list[str]]:
        """Alive, non-draining workers by role (``/health``)."""
        ready: dict[str, list[str]] = {}
        for wid, state in self.table.workers.items():
            if self.table.is_alive(wid) and not state.report.draining:
                ready.setdefault(state.report.role, []).append(wid)
        return ready

    def render_metrics(self, accept: str = "") -> tuple[bytes, str]:
        """The router's Prometheus scrape (``GET /metrics`` on the HTTP port)."""
        return self.metrics.render(accept)

    def max_model_len(self) -> int | None:
        """The largest context window an alive decode worker's engine serves (None before any reports one)."""
        return max((s.report.max_model_len for s in self.table.alive("decode") if s.report.max_model_len),
                   default=None)

    def served_models(self) -> list[str]:
        """``[served_name]`` once a worker of the model is alive, else nothing (``GET /v1/models``)."""
        alive = any(s.report.model_id and self.table.is_alive(wid) for wid, s in self.table.workers.items())
        return [self.served_name] if alive else []

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def _drain_and_close(self) -> None:
        """Withdraw (NATS queue group left, HTTP answers 503), let NATS and HTTP streams finish within the
        grace period, end the rest, then close HTTP and NATS."""
        if self.planner is not None:  # no more decisions once draining
            await self.planner.close()
        await self.runtime.withdraw()
        t0, serving = time.monotonic(), set(self.relays.values())
        if serving:
            await asyncio.wait(serving, timeout=self.config.drain_grace_s)
        grace_left = max(0.0, self.config.drain_grace_s - (time.monotonic() - t0))
        if self.relays:
            await self._end_streams()
        await self.runtime.finish_inflight(grace_left, self._end_streams)
        if self.http is not None:
            await self.http.stop()
        await self.runtime.close()

    async def _end_streams(self) -> None:
        self._draining = True
        for task in list(self.relays.values()):
            task.cancel()
