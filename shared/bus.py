"""NATS plumbing shared by every service: connect with reconnect, one error contract per handler, heartbeats
with load metrics, registration in a JetStream KV bucket with a TTL, and the drain lifecycle.

Lifecycle (each step idempotent; a service runs them in this order on SIGTERM, see ``Service.shutdown``):

1. ``withdraw()``: mark this service draining in an immediate heartbeat and in its registry entry (routers
   place nothing new here), leave queue groups (a peer in the group takes new work), and refuse work that
   still arrives on direct subjects with ``unavailable`` (the router re-places it elsewhere). Heartbeats go on,
   so routers keep treating streams still served here as alive. Control handlers (cancel, snapshots) still run.
2. ``finish_inflight(grace_s, hand_back)``: wait up to ``grace_s`` for work handlers to finish; then call
   ``hand_back()`` (the service gives what it still holds back to its router) and cancel what is left.
3. The service closes its own resources (transports, engine).
4. ``close()``: stop heartbeats, delete the registry entry, drain and close the NATS connection (last).

``Service`` is the base every service's lifecycle shares (``run_forever``, an idempotent ``shutdown``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import signal
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.msg import Msg

from shared import protocol, subjects, tracing
from shared.config import load_config, nats_servers
from shared.errors import DeepinferError, ErrorCode

logger = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]
HAND_BACK_WAIT_S = 5.0  # after hand_back(), how long handlers get to publish their last chunk
MAX_INFLIGHT_HANDLERS = 4096  # work handlers running at once per service; more are refused ``overloaded``


async def connect(url: str, name: str, on_closed: Callable[[], None] | None = None, *, user: str = "",
                  password: str = "", on_reconnected: Callable[[], None] | None = None) -> nats.NATS:
    """Connect, retrying forever on later disconnects (services outlive NATS restarts). ``url`` may name several
    servers, comma-separated (nodes of one NATS cluster), in order of preference (the host's own node first): the
    first connect takes the first that answers, and a lost node is replaced by another of them (or one the
    cluster advertised since), subscriptions kept. nats-py closes a
    connection for good on a server ``-ERR``; ``on_closed`` hears every close (``ServiceRuntime`` turns one it
    did not ask for into a stop with a failing exit code, so a supervisor restarts the service instead of it
    living on deaf). ``on_reconnected`` hears every reconnect (the router: heartbeats missed while it was away
    are its own silence, not the workers').

    Credentials: ``user``/``password`` (a service's ``nats_user``/``nats_password``), else those of a
    ``nats://user:pass@host:port`` URL, else none. With a user, every inbox of the connection lives under
    ``subjects.inbox_prefix(user)``, the only inboxes that user may subscribe to (``shared/nats_auth.py``).
    A permissions violation leaves the connection open and is logged as a warning (a misconfiguration).
    Credentials the server refuses on the first connect raise ``DeepinferError(unavailable)`` at once
    (nats-py would retry them forever); an unreachable server is still waited for."""
    async def on_disconnect():
        logger.info("%s: disconnected from NATS", name)

    async def on_reconnect():
        logger.info("%s: reconnected to NATS", name)
        if on_reconnected is not None:
            on_reconnected()

    async def on_error(err):
        text = str(err).lower()
        if (isinstance(err, nats.errors.AuthorizationError) or "authorization violation" in text) \
                and not refused.done():
            refused.set_result(err)
        if "permissions violation" in text:
            logger.warning("%s: NATS refused: %s", name, err)
        else:
            logger.debug("%s: NATS error %s", name, err)

    async def on_close():
        if on_closed is not None:
            on_closed()

    auth: dict = {}
    servers = nats_servers(url)
    login = user or urllib.parse.unquote(urllib.parse.urlsplit(servers[0]).username or "")
    if user:
        auth.update(user=user, password=password)
    if login:
        auth["inbox_prefix"] = subjects.inbox_prefix(login)
    refused: asyncio.Future = asyncio.get_running_loop().create_future()
    nc = nats.NATS()
    connecting = asyncio.ensure_future(nc.connect(
        servers, name=name, dont_randomize=True, connect_timeout=5, reconnect_time_wait=0.25,
        max_reconnect_attempts=-1, allow_reconnect=True, ping_interval=5, max_outstanding_pings=2, disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect, error_cb=on_error, closed_cb=on_close, **auth))
    try:
        await asyncio.wait([connecting, refused], return_when=asyncio.FIRST_COMPLETED)
        if connecting.done():
            await connecting  # raises what nats-py raised
            return nc
    except BaseException:  # nats-py failed, or we were cancelled
        await _abandon(nc, connecting)
        raise
    await _abandon(nc, connecting)  # refused: stop nats-py's retry loop
    hosts = ", ".join(str(urllib.parse.urlsplit(u).hostname) for u in servers)
    raise DeepinferError(ErrorCode.UNAVAILABLE, f"NATS at {hosts} refused user "
                         f"{login or '(none)'!r}: authorization violation (check DEEPINFER_NATS_USER / "
                         "DEEPINFER_NATS_PASSWORD)")


async def _abandon(nc: nats.NATS, connecting: asyncio.Future) -> None:
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    with contextlib.suppress(Exception):
        await nc.close()


async def reply_error(nc: nats.NATS, msg: Msg, err: DeepinferError) -> None:
    """Answer a failed request: body ``ErrorReply``, headers ``protocol.error_headers`` (NATS micro style)."""
    if msg.reply:
        await nc.publish(msg.reply, protocol.encode(protocol.ErrorReply.from_exception(err)),
                         headers=protocol.error_headers(err))


class ServiceRuntime:
    def __init__(self, nc: nats.NATS, info: protocol.WorkerInfo, *, heartbeat_s: float = 1.0,
                 registry_ttl_s: float = 5.0, max_inflight: int = MAX_INFLIGHT_HANDLERS,
                 registry_replicas: int = 1) -> None:
        self.nc, self.info, self.max_inflight = nc, info, max_inflight
        tracing.setup(info.role)   # on when OTEL_EXPORTER_OTLP_ENDPOINT is set
        self.instance = secrets.token_hex(8)  # this process in its heartbeats (a restart under the same id differs)
        self.registry_replicas = registry_replicas  # when this service creates the bucket (R3 in a 3-node cluster)
        self.heartbeat_s, self.registry_ttl_s = heartbeat_s, registry_ttl_s
        self.stop_requested = asyncio.Event()  # set by SIGTERM/SIGINT; the service then shuts down
        self.error_counts: dict[str, int] = {}
        self.draining = False
        self.connection_lost = False  # NATS closed the connection for good without our asking
        self._queue_subs: list = []
        self._inflight: set[asyncio.Task] = set()  # work handlers running now
        self._background: set[asyncio.Task] = set()
        self._load_fn: Callable[[], dict] | None = None
        self._kv = None
        self._registering: asyncio.Task | None = None  # the heartbeat loop's registry put in flight
        self._closed = False

    async def serve(self, subject: str, handler: Handler, queue: str = "", work: bool = True):
        """Subscribe ``handler``; every message runs as a task with the one error contract. ``work`` handlers
        are tracked for the drain, at most ``max_inflight`` at once (more are refused ``overloaded``), and
        refused once draining; control handlers (``work=False``) always run."""
        async def on_msg(msg: Msg) -> None:
            if work and self.draining:
                await reply_error(self.nc, msg, DeepinferError(ErrorCode.UNAVAILABLE,
                                                               f"{self.info.worker_id} is draining"))
                return
            if work and len(self._inflight) >= self.max_inflight:
                await reply_error(self.nc, msg, DeepinferError(
                    ErrorCode.OVERLOADED, f"{self.info.worker_id} has {self.max_inflight} requests in hand"))
                return
            task = asyncio.create_task(self._guard(subject, handler, msg))
            tasks = self._inflight if work else self._background
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=4096)
        if work and queue:
            self._queue_subs.append(sub)
        return sub

    async def _guard(self, subject: str, handler: Handler, msg: Msg) -> None:
        try:
            await handler(msg)
        except DeepinferError as err:
            self.error_counts[err.code.value] = self.error_counts.get(err.code.value, 0) + 1
            logger.info("%s: %s", subject, err)
            await reply_error(self.nc, msg, err)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.error_counts["internal"] = self.error_counts.get("internal", 0) + 1
            logger.exception("%s: handler failed", subject)
            await reply_error(self.nc, msg, DeepinferError(ErrorCode.INTERNAL, "internal error (see worker log)"))

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        """Run ``coro`` as a background task that is kept referenced and cancelled by ``close``."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def start_heartbeat(self, load_fn: Callable[[], dict]) -> None:
        self._load_fn = load_fn
        self.spawn(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        """Heartbeats keep their cadence whatever the registry does: a registry put runs beside them (one at a
        time), since after a NATS restart JetStream calls may each wait out their timeout, and heartbeats held
        behind them would make the router think the worker dead."""
        while True:
            await self.beat(register=False)
            if self._registering is None or self._registering.done():
                self._registering = self.spawn(self._register_logged())
            await asyncio.sleep(self.heartbeat_s)

    async def _register_logged(self) -> None:
        try:
            await self._register()
        except Exception as err:  # NATS or JetStream down: the next beat retries
            logger.debug("registry put failed: %s", err)

    async def beat(self, register: bool = True) -> None:
        """Publish one heartbeat and (``register``) refresh the registry entry (failures are logged: NATS may be
        down)."""
        if self._load_fn is None or self._closed:
            return
        try:
            report = protocol.LoadReport(worker_id=self.info.worker_id, role=self.info.role,
                                         model_id=self.info.model_id, transports=list(self.info.transports),
                                         block_size=self.info.block_size, host=self.info.host,
                                         timestamp=time.time(), draining=self.draining, instance=self.instance,
                                         **self._load_fn())
            await self.nc.publish(subjects.load(self.info.worker_id, self.info.role), protocol.encode(report))
            if register:
                await self._register()
        except Exception as err:  # NATS down: keep beating, reconnect is automatic
            logger.debug("heartbeat failed: %s", err)

    async def _register(self) -> None:
        """Put this service's entry in the registry bucket (created when missing). A failed put forgets the
        bucket handle, so a server that lost its JetStream store gets the bucket back on the next beat."""
        if self._kv is None:
            js = self.nc.jetstream(timeout=2)
            try:
                self._kv = await js.key_value(subjects.REGISTRY_BUCKET)
            except Exception:
                from nats.js.api import KeyValueConfig
                self._kv = await js.create_key_value(KeyValueConfig(bucket=subjects.REGISTRY_BUCKET,
                                                                    ttl=self.registry_ttl_s,
                                                                    replicas=self.registry_replicas))
        try:
            await self._kv.put(self.info.worker_id, protocol.encode(self.info))
        except Exception:
            self._kv = None
            raise

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)

    def connection_closed(self) -> None:
        """The ``on_closed`` of ``connect``: a close we did not ask for stops the service (exit code 1)."""
        if not self._closed and not self.connection_lost:
            logger.error("%s: NATS closed the connection for good; stopping", self.info.worker_id)
            self.connection_lost = True
            self.stop_requested.set()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def withdraw(self) -> None:
        """Step 1: stop being placed on (draining heartbeat + registry entry), leave queue groups."""
        if self.draining:
            return
        self.draining = True
        self.info = dataclasses.replace(self.info, draining=True)
        logger.info("%s: draining (%d in flight)", self.info.worker_id, len(self._inflight))
        for sub in self._queue_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.beat()

    async def rejoin(self, info: protocol.WorkerInfo) -> None:
        """After a drain that did not close (a role switch): serve again as ``info`` (heartbeat + registry)."""
        self.info, self.draining = dataclasses.replace(info, draining=False), False
        await self.beat()

    async def finish_inflight(self, grace_s: float,
                              hand_back: Callable[[], Awaitable[None]] | None = None) -> None:
        """Step 2: wait up to ``grace_s`` for work handlers; then ``hand_back()`` and cancel what is left."""
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=grace_s)
        if self._inflight and hand_back is not None:
            logger.info("%s: handing back %d requests", self.info.worker_id, len(self._inflight))
            await hand_back()
            if self._inflight:
                await asyncio.wait(list(self._inflight), timeout=HAND_BACK_WAIT_S)
        for task in list(self._inflight):
            task.cancel()

    async def close(self) -> None:
        """Step 4: stop heartbeats, delete the registry entry, drain NATS. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        with contextlib.suppress(Exception):
            if self._kv is not None:
                await asyncio.wait_for(self._kv.delete(self.info.worker_id), 2)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), 5)
        with contextlib.suppress(Exception):   # spans still batched for the collector
            await asyncio.to_thread(tracing.flush)
        logger.info("%s: closed", self.info.worker_id)


class Service:
    """The lifecycle every service shares. Subclasses set ``runtime`` in ``start`` and implement
    ``_drain_and_close`` (the drain steps above); ``connect(..., on_closed=self._on_nats_closed)``."""

    runtime: ServiceRuntime | None = None
    _shutdown: asyncio.Task | None = None

    async def start(self) -> None:
        raise NotImplementedError

    async def _drain_and_close(self) -> None:
        raise NotImplementedError

    async def run_forever(self) -> int:
        """Serve until SIGTERM/SIGINT (exit code 0) or until NATS closes the connection for good (1)."""
        await self.start()
        self.runtime.install_signal_handlers()
        await self.runtime.stop_requested.wait()
        await self.shutdown()
        return 1 if self.runtime.connection_lost else 0

    async def shutdown(self) -> None:
        """Drain and stop. Idempotent; concurrent calls wait for the same drain."""
        if self._shutdown is None:
            self._shutdown = asyncio.create_task(self._drain_and_close())
        await asyncio.shield(self._shutdown)

    def _on_nats_closed(self) -> None:
        if self.runtime is not None:
            self.runtime.connection_closed()


def service_main(service_cls: Callable[[Any], Service], config_cls: type, argv: list[str] | None = None,
                 prepare: Callable[[Any], None] | None = None, **overrides: Any) -> None:
    """Every ``python -m services.<name>``: logging, the config (defaults <- ``DEEPINFER_*`` env <- flags <-
    ``overrides``), ``prepare(config)`` before any thread or event loop exists, then serve until SIGTERM/SIGINT
    and exit with ``run_forever``'s code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(config_cls, argv if argv is not None else sys.argv[1:], **overrides)
    if prepare is not None:
        prepare(config)
    sys.exit(asyncio.run(service_cls(config).run_forever()))
