"""Draft service: answers ``DraftRequest``s on ``subjects.draft(model)`` (queue group ``drafters``, so replicas
share the load) with one proposal per sequence from its drafter (``shared/spec/factory.py``).

Invariants: one drafting forward at a time (the model is not re-entrant; requests wait their turn, bounded by
the runtime's in-flight limit, and decode workers give up after their own short timeout and decode without
speculation); bad input gets an error reply; a request for more sequences than ``MAX_DRAFT_SEQUENCES`` or a
``k`` above ``MAX_DRAFT_K`` never decodes; a request that waited longer than its ``budget_s`` for its turn is
dropped unanswered (its asker decoded without it already; counted in ``stale``). SIGTERM: leave the queue group, finish what is in hand, stop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import torch

from shared.host_identity import host_id
from shared import protocol, subjects
from shared.bus import Service, ServiceRuntime, connect, service_main
from services.draft.config import DraftConfig
from shared.engine.config import EngineConfig
from services.draft.metrics import DraftMetrics
from shared.metrics.server import MetricsServer
from shared.model.llama import LlamaModel
from shared.model.loader import build_model, load_model_files
from shared.spec.factory import make_drafter
from shared.spec.remote import reply_for, sequences_of

logger = logging.getLogger(__name__)

MAX_INFLIGHT = 64


def load_target(config: DraftConfig) -> LlamaModel:
    engine_cfg = EngineConfig(dtype=config.dtype, device="auto", num_threads=config.threads or None)
    torch.set_num_threads(engine_cfg.resolve_threads())
    model_config, weights, _ = load_model_files(config.model or None)
    device = engine_cfg.resolve_device()
    return build_model(model_config, weights, engine_cfg.resolve_dtype(device), device)


class DraftService(Service):
    def __init__(self, config: DraftConfig) -> None:
        self.config = config
        self.drafter = None
        self.nc = None
        self.subject = ""  # where it answers: subjects.draft(<the model id>)
        self._lock = asyncio.Lock()
        self.served = self.sequences = self.tokens = self.stale = 0
        self.metrics = DraftMetrics(config.worker_id, config.drafter)  # counters above read at scrape time
        self.metrics.watch(self)
        self.metrics_server = MetricsServer(self.metrics.registry, config.worker_id)

    async def start(self) -> None:
        c = self.config
        logger.info("starting %s with %s", c.worker_id, c)
        target = await asyncio.to_thread(load_target, c)
        self.drafter = await asyncio.to_thread(make_drafter, c.drafter, target, c.window, False)
        model_id = target.config.model_id
        self.nc = await connect(c.nats_url, c.worker_id, on_closed=self._on_nats_closed, user=c.nats_user,
                                password=c.nats_password)
        info = protocol.WorkerInfo(worker_id=c.worker_id, role="draft", model_id=model_id, host=host_id(c.host_id),
                                   pid=os.getpid(), transports=[], block_size=0, started_at=time.time())
        self.runtime = ServiceRuntime(self.nc, info, heartbeat_s=c.heartbeat_s, max_inflight=MAX_INFLIGHT,
                                      registry_replicas=c.registry_replicas)
        self.subject = subjects.draft(subjects.safe_token(model_id))
        await self.runtime.serve(self.subject, self.on_draft, queue="drafters")
        await self.runtime.serve(subjects.stats(c.worker_id), self.on_stats, work=False)
        self.runtime.start_heartbeat(lambda: {"num_running": int(self._lock.locked()),
                                              "num_waiting": self.runtime.num_inflight, "kv_usage": 0.0,
                                              "num_free_blocks": 0, "num_total_blocks": 0})
        if c.metrics_port:
            await self.metrics_server.start(c.metrics_port)
        logger.info("%s ready: drafter %s for %s", c.worker_id, c.drafter, model_id)

    async def on_draft(self, msg) -> None:
        t0 = time.perf_counter()
        req = protocol.decode(msg.data, protocol.DraftRequest)
        sequences = sequences_of(req)
        async with self._lock:
            t_forward = time.perf_counter()
            if req.budget_s and t_forward - t0 >= req.budget_s:
                self.stale += 1
                return
            proposals = await asyncio.to_thread(self.drafter.propose, sequences, req.k)
            self.metrics.forward_seconds.observe(time.perf_counter() - t_forward)
        self.served += 1
        self.sequences += len(sequences)
        self.tokens += sum(len(p.tokens) for p in proposals)
        if msg.reply:
            await msg.respond(protocol.encode(reply_for(proposals)))
        self.metrics.request_seconds.observe(time.perf_counter() - t0)

    async def on_stats(self, msg) -> None:
        if msg.reply:
            stats = {"drafter": self.config.drafter, "requests": self.served, "sequences": self.sequences,
                     "proposed_tokens": self.tokens, "stale": self.stale, "errors": dict(self.runtime.error_counts)}
            await msg.respond(protocol.encode(protocol.StatsReply(worker_id=self.config.worker_id, role="draft",
                                                                  stats=stats)))

    async def _drain_and_close(self) -> None:
        if self.runtime is None:
            return
        await self.runtime.withdraw()
        await self.runtime.finish_inflight(self.config.drain_grace_s)
        await self.runtime.close()
        await self.metrics_server.stop()
        logger.info("%s stopped", self.config.worker_id)


def main(argv: list[str] | None = None) -> None:
    service_main(DraftService, DraftConfig, argv)
