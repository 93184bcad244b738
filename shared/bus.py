"""NATS plumbing shared by every service: connect with reconnect, one error contract per handler, heartbeats
with load metrics, registration in a JetStream KV bucket with a TTL, and a drain-on-signal lifecycle.

Lifecycle (idempotent): ``stop()`` → unsubscribe (stop taking work) → wait up to ``grace_s`` for in-flight
handlers → cancel the rest → delete the registry entry → drain and close the connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import nats
from nats.aio.msg import Msg

from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode

logger = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]


async def connect(url: str, name: str) -> nats.NATS:
    """Connect, retrying forever on later disconnects (services outlive NATS restarts)."""
    async def on_disconnect():
        logger.info("%s: disconnected from NATS", name)

    async def on_reconnect():
        logger.info("%s: reconnected to NATS", name)

    async def on_error(err):
        logger.debug("%s: NATS error %s", name, err)

    return await nats.connect(url, name=name, connect_timeout=5, reconnect_time_wait=0.25,
                              max_reconnect_attempts=-1, allow_reconnect=True, ping_interval=5,
                              max_outstanding_pings=2, disconnected_cb=on_disconnect,
                              reconnected_cb=on_reconnect, error_cb=on_error)


async def reply_error(msg: Msg, err: DeepinferError) -> None:
    if msg.reply:
        await msg.respond(protocol.encode(protocol.ErrorReply.from_exception(err)))


class ServiceRuntime:
    def __init__(self, nc: nats.NATS, info: protocol.WorkerInfo, *, heartbeat_s: float = 1.0,
                 registry_ttl_s: float = 5.0, grace_s: float = 10.0) -> None:
        self.nc, self.info = nc, info
        self.heartbeat_s, self.registry_ttl_s, self.grace_s = heartbeat_s, registry_ttl_s, grace_s
        self.stopped = asyncio.Event()
        self.error_counts: dict[str, int] = {}
        self._subs: list = []
        self._inflight: set[asyncio.Task] = set()
        self._background: list[asyncio.Task] = []
        self._kv = None
        self._stopping = False

    async def serve(self, subject: str, handler: Handler, queue: str = "") -> None:
        """Subscribe ``handler``; every message runs as a tracked task with the one error contract."""
        async def on_msg(msg: Msg) -> None:
            if self._stopping:
                await reply_error(msg, DeepinferError(ErrorCode.UNAVAILABLE, "worker is shutting down"))
                return
            task = asyncio.create_task(self._guard(subject, handler, msg))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=4096))

    async def _guard(self, subject: str, handler: Handler, msg: Msg) -> None:
        try:
            await handler(msg)
        except DeepinferError as err:
            self.error_counts[err.code.value] = self.error_counts.get(err.code.value, 0) + 1
            logger.info("%s: %s", subject, err)
            await reply_error(msg, err)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.error_counts["internal"] = self.error_counts.get("internal", 0) + 1
            logger.exception("%s: handler failed", subject)
            await reply_error(msg, DeepinferError(ErrorCode.INTERNAL, "internal error (see worker log)"))

    def start_heartbeat(self, load_fn: Callable[[], dict]) -> None:
        self._background.append(asyncio.create_task(self._heartbeat(load_fn)))

    async def _heartbeat(self, load_fn: Callable[[], dict]) -> None:
        subject = subjects.load(self.info.worker_id)
        while True:
            try:
                report = protocol.LoadReport(worker_id=self.info.worker_id, role=self.info.role,
                                             model_id=self.info.model_id, transports=list(self.info.transports),
                                             block_size=self.info.block_size, host=self.info.host,
                                             timestamp=time.time(), **load_fn())
                await self.nc.publish(subject, protocol.encode(report))
                await self._register()
            except Exception as err:  # NATS down: keep beating, reconnect is automatic
                logger.debug("heartbeat failed: %s", err)
            await asyncio.sleep(self.heartbeat_s)

    async def _register(self) -> None:
        if self._kv is None:
            js = self.nc.jetstream(timeout=2)
            try:
                self._kv = await js.key_value(subjects.REGISTRY_BUCKET)
            except Exception:
                from nats.js.api import KeyValueConfig
                self._kv = await js.create_key_value(KeyValueConfig(bucket=subjects.REGISTRY_BUCKET,
                                                                    ttl=self.registry_ttl_s))
        await self._kv.put(self.info.worker_id, protocol.encode(self.info))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))

    async def stop(self) -> None:
        if self._stopping:
            await self.stopped.wait()
            return
        self._stopping = True
        logger.info("%s: stopping (%d in flight)", self.info.worker_id, len(self._inflight))
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._inflight:
            _, pending = await asyncio.wait(list(self._inflight), timeout=self.grace_s)
            for task in pending:
                task.cancel()
        for task in self._background:
            task.cancel()
        with contextlib.suppress(Exception):
            if self._kv is not None:
                await asyncio.wait_for(self._kv.delete(self.info.worker_id), 2)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), 5)
        self.stopped.set()
