"""What prefill and decode workers share: engine start-up, transports, NATS runtime, cancellation."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys

from shared import protocol, subjects
from shared.bus import ServiceRuntime, connect
from shared.config import WorkerConfig, load_config
from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.kv.transport import available_transports, make_transport
from services.kv_events import KVEventPublisher

logger = logging.getLogger(__name__)


class Worker:
    """Base of a worker service. Subclasses register their handlers in ``serve_handlers``."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.nc = None
        self.runtime: ServiceRuntime | None = None
        self.aengine: AsyncEngine | None = None
        self.transports: dict = {}
        self.active: dict[str, asyncio.Task] = {}  # request id -> the task serving it (for cancel)

    @property
    def engine(self) -> LLMEngine:
        return self.aengine.engine

    async def start(self) -> None:
        c = self.config
        logger.info("starting %s with %s", c.worker_id, c)
        engine_cfg = EngineConfig(block_size=c.block_size, kv_cache_bytes=c.kv_cache_mb << 20,
                                  max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                                  dtype=c.dtype, device=c.device, num_threads=c.threads or None)
        engine = await asyncio.to_thread(LLMEngine.from_path, c.model or None, engine_cfg)
        self.nc = await connect(c.nats_url, c.worker_id)
        self.kv_events = KVEventPublisher(self.nc, c.worker_id, self._cached_hashes)
        engine.block_manager.event_sink = self.kv_events.sink  # set before the engine thread starts
        self.aengine = AsyncEngine(engine)
        self.aengine.start()
        wanted = [t.strip() for t in c.transports.split(",") if t.strip()]
        offered = [t for t in wanted if t in available_transports()]
        self.transports = {t: make_transport(t, self.nc, c.worker_id) for t in offered}
        info = protocol.WorkerInfo(worker_id=c.worker_id, role=c.role, model_id=engine.model.config.model_id,
                                   host=socket.gethostname(), pid=os.getpid(), transports=offered,
                                   block_size=c.block_size, started_at=0.0)
        self.runtime = ServiceRuntime(self.nc, info, heartbeat_s=c.heartbeat_s)
        await self.serve_handlers()
        await self.runtime.serve(subjects.CANCEL, self.on_cancel)
        await self.runtime.serve(subjects.ctl(c.worker_id, "kv_snapshot"), self.kv_events.on_snapshot)
        self.kv_events.start()
        self.runtime.start_heartbeat(lambda: {**self.aengine.load(), "kv_event_seq": self.kv_events.seq})
        logger.info("%s ready (transports %s)", c.worker_id, offered)

    async def serve_handlers(self) -> None:
        raise NotImplementedError

    async def _cached_hashes(self) -> list[int]:
        return await self.aengine.call(lambda: list(self.engine.block_manager.cached))

    async def on_cancel(self, msg) -> None:
        req = protocol.decode(msg.data, protocol.CancelRequest)
        task = self.active.get(req.request_id)
        if task is not None:
            logger.info("[%s] cancelled", req.request_id)
            task.cancel()

    def track(self, request_id: str) -> None:
        self.active[request_id] = asyncio.current_task()

    def untrack(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    async def publish_output(self, reply_to: str, seq: int, out: RequestOutput, extra_usage: dict | None = None) -> None:
        usage = None
        if out.finished:
            usage = {"prompt_tokens": out.num_prompt_tokens, "cached_tokens": out.num_cached_tokens,
                     "completion_tokens": out.num_output_tokens,
                     "tpot_ms": (out.tpot or 0.0) * 1000.0, **(extra_usage or {})}
        chunk = protocol.TokenChunk(request_id=out.request_id, seq=seq, token_ids=list(out.new_token_ids),
                                    text=out.new_text, final=out.finished, finish_reason=out.finish_reason,
                                    usage=usage)
        await self.nc.publish(reply_to, protocol.encode(chunk))

    async def run_forever(self) -> None:
        await self.start()
        self.runtime.install_signal_handlers()
        await self.runtime.stopped.wait()
        for task in list(self.active.values()):
            task.cancel()
        await self.kv_events.stop()
        for transport in self.transports.values():
            await transport.close()
        await self.aengine.stop()
        logger.info("%s stopped", self.config.worker_id)


def main_for(service_cls: type[Worker], role: str, argv: list[str] | None = None) -> None:
    """``python -m services.<role>``: configure logging, build the config (env then flags), serve until
    SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(WorkerConfig, argv if argv is not None else sys.argv[1:], role=role)
    asyncio.run(service_cls(config).run_forever())
