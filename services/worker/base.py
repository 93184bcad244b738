"""What prefill and decode workers share: engine start-up, transports, NATS runtime, cancellation, drain.

Drain (SIGTERM, ``shutdown``; idempotent): withdraw (a draining heartbeat and registry entry; new work is
refused with ``unavailable`` and the router places it elsewhere) → let in-flight requests finish for up to
``drain_grace_s`` → hand back the rest (each gets a final ``worker_lost`` chunk after the last token it
streamed, so the router continues it elsewhere from prompt + delivered tokens) → close KV events,
transports and the engine → drain NATS last. No request is lost: every one either finishes here or is handed
back.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from shared.host_identity import host_id
from shared.model.locate import served_model_name
from shared import protocol, subjects
from shared.bus import HAND_BACK_WAIT_S, Service, ServiceRuntime, connect, service_main
from services.worker.config import WorkerConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.errors import DeepinferError, ErrorCode
from shared.kv.kv_codec import codec_for
from shared.kv.registry import available_transports, make_transport
from shared.kv_events import KVEventPublisher
from services.worker.tier_client import TierClient
from shared.metrics.common import OUTCOME_CANCELLED
from shared.metrics.server import MetricsServer
from services.worker.metrics import WorkerMetrics
from services.worker.router_watch import RouterWatch
from services.worker.tier import TierMixin

logger = logging.getLogger(__name__)


class Worker(TierMixin, Service):
    """Base of a worker service. Subclasses register their handlers in ``serve_handlers``, and bracket every
    request they accept with ``track`` / ``untrack(outcome)`` (its metrics: ``self.metrics``, served on
    ``metrics_port`` from start to the end of the drain)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.nc = None
        self.runtime: ServiceRuntime | None = None
        self.aengine: AsyncEngine | None = None
        self.transports: dict = {}
        self.active: dict[str, tuple[asyncio.Task, str]] = {}  # request id -> (task serving it, reply subject)
        self.tier: TierClient | None = None
        self.spec_log = None
        self.metrics = WorkerMetrics(config.worker_id, "switchable" if config.switchable else config.role,
                                     model_name=served_model_name(config.model or None))
        self.metrics.watch(self)
        self.metrics_server = MetricsServer(self.metrics.registry, config.worker_id)
        self._handing_back = False
        self.router_watch: RouterWatch | None = None

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    async def start(self) -> None:
        c = self.config
        logger.info("starting %s with %s", c.worker_id, c)
        engine_cfg = EngineConfig(block_size=c.block_size, kv_cache_bytes=c.kv_cache_mb << 20,
                                  max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                                  dtype=c.dtype, device=c.device, num_threads=c.threads or None,
                                  swa_kv_context=c.swa_kv_context or None,
                                  scheduling_policy=c.scheduling_policy, rope_scaling=c.rope_scaling_dict())
        self.nc = await connect(c.nats_url, c.worker_id, on_closed=self._on_nats_closed, user=c.nats_user,
                                password=c.nats_password, on_reconnected=self._on_reconnected)
        self.kv_events = KVEventPublisher(self.nc, c.worker_id, self._cached_hashes)
        loop = asyncio.get_running_loop()

        def build() -> LLMEngine:  # on the engine thread: the only thread of this process that runs torch ops
            engine = LLMEngine.from_path(c.model or None, engine_cfg)
            engine.set_kv_event_sink(self.kv_events.sink)  # before stepping starts
            if (c.role == "decode" or c.switchable) and c.draft:
                engine.set_speculator(self._speculator(engine, loop))
            return engine

        try:
            self.aengine = await AsyncEngine.launch(build)
        except BaseException:
            await self.nc.close()  # nothing was served yet: a worker that cannot load leaves no connection
            raise
        engine = self.aengine.engine
        wanted = [t.strip() for t in c.transports.split(",") if t.strip()]
        offered = [t for t in wanted if t in available_transports()]
        codec = codec_for(c.tier_kv_format)
        if codec is not None and engine.kv_port.carries_state:   # its codec quantises per K/V head rows
            logger.warning("%s: %s's tier blocks are compressed entries and states: stored in %s, not %s",
                           c.worker_id, engine.model.config.model_id, engine.kv_port.dtype_name, c.tier_kv_format)
            codec = None
        self.transports = {t: make_transport(t, self.nc, c.worker_id) for t in offered}
        host = host_id(c.host_id)
        if c.cache_tier:
            host_transports = {t: tr for t, tr in self.transports.items() if t != "cuda_ipc"}
            self.tier = TierClient(self.nc, c.worker_id, c.cache_tier, host, host_transports, c.tier_timeout_s,
                                   c.tier_write_queue, codec)
            await self.tier.start()
            await self.tier.warm_staging(engine.kv_port.block_bytes)
            self.start_preempt_offers()   # before any request: the engine thread reads the hook from now on
        info = protocol.WorkerInfo(worker_id=c.worker_id, role=c.role, model_id=engine.model.config.model_id,
                                   host=host, pid=os.getpid(), transports=offered,
                                   block_size=c.block_size, started_at=0.0, model_fingerprint=engine.fingerprint)
        self.runtime = ServiceRuntime(self.nc, info, heartbeat_s=c.heartbeat_s, registry_replicas=c.registry_replicas)
        self.router_watch = RouterWatch(self.nc, c.router_dead_after_s, self.runtime.spawn)
        self.runtime.spawn(self._stop_orphans())
        await self.serve_handlers()
        await self.runtime.serve(subjects.WORK_CANCEL, self.on_cancel, work=False)
        await self.runtime.serve(subjects.ctl(c.worker_id, "kv_snapshot"), self.kv_events.on_snapshot, work=False)
        await self.runtime.serve(subjects.ctl(c.worker_id, "probe"), self.on_probe, work=False)
        await self.runtime.serve(subjects.stats(c.worker_id), self.on_stats, work=False)
        self.kv_events.start()
        self.runtime.start_heartbeat(lambda: {**self.aengine.load(), "kv_event_seq": self.kv_events.seq,
                                              "switchable": self.config.switchable,
                                              "block_bytes": engine.kv_port.block_bytes,
                                              "tier_block_s": self.tier.counters.block_pull_s if self.tier else 0.0})
        if c.metrics_port:
            await self.metrics_server.start(c.metrics_port)
        logger.info("%s ready (transports %s)", c.worker_id, offered)

    async def serve_handlers(self) -> list:
        raise NotImplementedError

    def _speculator(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop):
        """Speculative decoding for this decode worker: an in-process drafter or the draft service, the
        confidence head (the drafter's shipped head, else fixed k), the acceptance log when asked for."""
        from shared.engine.speculator import SpecConfig, Speculator
        from shared.spec.acceptance_log import AcceptanceLog
        from shared.spec.confidence import FixedK, load_head
        from shared.spec.factory import make_drafter, shipped_head
        from shared.spec.remote import RemoteDrafter

        c = self.config
        if c.draft == "local":
            drafter = make_drafter(c.drafter, engine.model)
        else:
            subject = subjects.draft(subjects.safe_token(engine.model.config.model_id))
            drafter = RemoteDrafter(self.nc, loop, subject, c.draft_timeout_s)
        head_path = c.spec_head or (shipped_head(c.drafter) if c.draft == "local" else None)
        head = load_head(head_path, c.spec_k) if head_path else FixedK(c.spec_k)
        self.spec_log = AcceptanceLog(c.spec_log) if c.spec_log else None
        logger.info("%s: speculative decoding with %s drafter %s, head %r, k=%d up to %d sequences", c.worker_id,
                    c.draft, getattr(drafter, "name", "?"), head, c.spec_k, c.spec_max_batch)
        return Speculator(drafter, SpecConfig(k=c.spec_k, max_batch=c.spec_max_batch, default_on=c.spec_default),
                          head, self.spec_log)

    async def _cached_hashes(self) -> list[int]:
        return await self.aengine.call(self.engine.cached_block_hashes)

    async def on_cancel(self, msg) -> None:
        req = protocol.decode(msg.data, protocol.CancelRequest)
        entry = self.active.get(req.request_id)
        if entry is not None:
            logger.info("[%s] cancelled", req.request_id)
            entry[0].cancel()

    async def on_probe(self, msg) -> None:
        """Answer whether a request is still held here (queued, running or handing off)."""
        probe = protocol.decode(msg.data, protocol.RequestProbe)
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(ok=probe.request_id in self.active)))

    async def on_stats(self, msg) -> None:
        """Reply with load, prefix-cache and cache-tier figures (``deepinfer status``)."""
        if not msg.reply:
            return
        bm = self.engine.block_manager
        spec = self.engine.speculator
        stats = {**self.aengine.load(), "prefix_query_tokens": bm.num_query_tokens,
                 "prefix_hit_tokens": bm.num_hit_tokens, "kv_pools": self.engine.kv_pools(),
                 "errors": dict(self.runtime.error_counts),
                 "tier": self.tier.stats() if self.tier else None, "speculative": spec.stats() if spec else None}
        await msg.respond(protocol.encode(protocol.StatsReply(worker_id=self.config.worker_id,
                                                              role=self.config.role, stats=stats)))

    async def kv_source(self, request_id: str, ids: list[int], next_query: int | None = None):
        """``(cache, rows, window_mask)`` a transport stages the held request's blocks ``ids`` from: the cache
        itself (no engine round trip: held blocks do not change), or with KV groups a packed copy gathered on the
        engine thread (``KVPort.source``; ``next_query``: the importer's first query position)."""
        eng = self.engine
        if eng.kv_port.stages_in_place:
            return eng.kv_port.kv_cache, list(ids), b""
        return await self.aengine.call(lambda: eng.kv_port.source(request_id, ids, next_query))

    async def track(self, request_id: str, reply_to: str, router_id: str = "", router_instance: str = "") -> None:
        """Bracket an accepted request (with ``untrack``); its stream is relayed by ``router_id`` (watched). Raises
        only ``CancelledError``, and then tracks nothing."""
        await self.router_watch.hold(request_id, router_id, router_instance)
        self.active[request_id] = (asyncio.current_task(), reply_to)
        self.metrics.request_started(request_id)

    def untrack(self, request_id: str, outcome: str) -> None:
        """The request left this worker; ``outcome`` (``finished``, ``handed_off``, ``cancelled`` or an error
        code) is counted once in ``deepinfer_worker_requests_total``."""
        self.active.pop(request_id, None)
        self.router_watch.release(request_id)
        self.metrics.request_ended(request_id, outcome)

    def _on_reconnected(self) -> None:
        if self.router_watch is not None:
            self.router_watch.reconnected()

    async def _stop_orphans(self) -> None:
        """Cancel requests whose router died (``services/worker/router_watch.py``): no one reads their stream any more."""
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            for request_id in self.router_watch.sweep():
                entry = self.active.get(request_id)
                if entry is not None and not entry[0].done() and not entry[0].cancelling():
                    logger.warning("[%s] its router is gone: cancelled", request_id)
                    entry[0].cancel()

    def cancelled_outcome(self) -> str:
        """The outcome of a request whose task was cancelled: handed back while draining, else cancelled."""
        return ErrorCode.WORKER_LOST.value if self._handing_back else OUTCOME_CANCELLED

    async def publish_output(self, reply_to: str, seq: int, out: RequestOutput,
                             extra_usage: dict | None = None) -> None:
        usage = None
        if out.finished:
            usage = {"prompt_tokens": out.num_prompt_tokens, "cached_tokens": out.num_cached_tokens,
                     "completion_tokens": out.num_output_tokens,
                     "tpot_ms": (out.tpot or 0.0) * 1000.0, **(extra_usage or {})}
            if out.num_spec_steps:
                usage.update(spec_steps=out.num_spec_steps, spec_drafted_tokens=out.num_drafted_tokens,
                             spec_accepted_tokens=out.num_accepted_tokens)
        chunk = protocol.TokenChunk(request_id=out.request_id, seq=seq, token_ids=list(out.new_token_ids),
                                    text=out.new_text, final=out.finished, finish_reason=out.finish_reason,
                                    usage=usage, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs)
        await self.nc.publish(reply_to, protocol.encode(chunk))
        self.metrics.output(out.request_id, seq, len(out.new_token_ids), out.finish_reason if out.finished else None,
                            out.tpot)

    async def _drain_and_close(self) -> None:
        rt = self.runtime
        await rt.withdraw()
        await rt.finish_inflight(self.config.drain_grace_s, self.hand_back)
        await self.kv_events.stop()
        if self.tier is not None:
            await self.tier.close()
        for transport in self.transports.values():
            await transport.close()
        await self.aengine.stop()
        if self.spec_log is not None:
            self.spec_log.close()
        await rt.close()
        await self.metrics_server.stop()
        logger.info("%s stopped", self.config.worker_id)

    async def hand_back(self) -> None:
        """Stop every request still served here; each one that did not finish meanwhile gets a final
        ``worker_lost`` chunk, published after its last token, so its router continues it elsewhere."""
        held = dict(self.active)
        if not held:
            return
        self._handing_back = True
        for task, _ in held.values():
            task.cancel()
        await asyncio.wait([task for task, _ in held.values()], timeout=HAND_BACK_WAIT_S)
        err = DeepinferError(ErrorCode.WORKER_LOST, f"{self.config.worker_id} is shutting down: handed back")
        for rid, (task, reply_to) in held.items():
            if task.cancelled():
                with contextlib.suppress(Exception):
                    await self.nc.publish(reply_to, protocol.encode(protocol.TokenChunk.from_error(rid, 0, err)))
        logger.info("%s handed back %d requests", self.config.worker_id, sum(t.cancelled() for t, _ in held.values()))


def main_for(service_cls: type[Worker], role: str, argv: list[str] | None = None) -> None:
    """``python -m services.<role>``: one worker of ``role`` (``shared/bus.service_main``)."""
    service_main(service_cls, WorkerConfig, argv, role=role)
