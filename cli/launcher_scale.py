"""``deepinfer up``'s side of the P:D planner's scaling: the router's ``LauncherScaler`` asks on
``subjects.launcher_scale()`` for one prefill or decode worker more or fewer; the launcher that runs the
cluster's processes starts one (the role's next index) or drains its newest one (SIGTERM: it withdraws, its
decode streams live-migrate away, the rest finish or are handed back).

Invariants: a role never goes above ``max_workers[role]`` nor below ``min_workers`` live workers (counting the
ones starting, not the ones draining); a refused request is an ``ErrorReply`` (``overloaded`` at the maximum,
``unavailable`` at the minimum) and changes nothing; the reply (an ``Ack`` whose ``detail`` is the role's new
count) comes as soon as the process is started or signalled: its health is waited for in the background, and a
worker that fails to start is logged (the planner sees no heartbeat and decides again). The desk connects as the
``launcher`` NATS user, the only one that may hear these requests (the router the only one that may send them),
so no other credential can answer the planner with a false count.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from shared import nats_auth, protocol, subjects
from shared.bus import reply_error
from shared.errors import DeepinferError, ErrorCode

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class LauncherScaleDesk:
    def __init__(self, cluster, max_workers: Mapping[str, int], min_workers: int = 1,
                 start_timeout_s: float = 180.0) -> None:
        self.cluster, self.max_workers, self.min_workers = cluster, dict(max_workers), min_workers
        self.start_timeout_s = start_timeout_s
        spec = cluster.spec
        self.indices = {"prefill": list(range(spec.prefill)), "decode": list(range(spec.decode))}  # live ones
        self.nc = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.nc = await self.cluster.connect_as(nats_auth.LAUNCHER, "launcher-scale")
        await self.nc.subscribe(subjects.launcher_scale(), cb=self.on_scale)

    def count(self, role: str) -> int:
        return len(self.indices[role])

    async def on_scale(self, msg) -> None:
        try:
            order = protocol.decode(msg.data, protocol.ScaleRequest)
            start = self.reserve(order.role) if order.delta > 0 else None
            count = self.count(order.role) if start is not None else self.shrink(order.role)
            if msg.reply:   # before the start: a new worker's NATS user may reload the server's config, which
                await msg.respond(protocol.encode(protocol.Ack(detail=str(count))))  # voids pending replies
            if start is not None:
                self.start_reserved(order.role, start)
        except DeepinferError as err:
            logger.info("scale request refused: %s", err)
            await reply_error(self.nc, msg, err)

    def reserve(self, role: str) -> int:
        """Count ``role``'s next worker in (``OVERLOADED`` at the maximum); its index, for ``start_reserved``."""
        if self.count(role) >= self.max_workers.get(role, 0):
            raise DeepinferError(ErrorCode.OVERLOADED, f"{role} is at its maximum of "
                                 f"{self.max_workers.get(role, 0)} workers")
        index = max(self.indices[role], default=-1) + 1
        while self.cluster.worker_id(role, index) in self.cluster.procs:  # never reuse an id: its log, KV events
            index += 1
        self.indices[role].append(index)
        return index

    def start_reserved(self, role: str, index: int) -> None:
        try:
            name = self.cluster.spawn_worker(role, index)
        except Exception:
            self.indices[role].remove(index)
            raise
        logger.info("planner asked for a %s worker: started %s", role, name)
        self._spawn(self._watch_start(role, index, name))

    def grow(self, role: str) -> int:
        """Start ``role``'s next worker; the role's new count."""
        self.start_reserved(role, self.reserve(role))
        return self.count(role)

    def shrink(self, role: str) -> int:
        """Drain ``role``'s newest worker; the role's new count."""
        if self.count(role) <= self.min_workers:
            raise DeepinferError(ErrorCode.UNAVAILABLE, f"{role} is at its minimum of {self.min_workers} workers")
        index = self.indices[role].pop()
        name = self.cluster.worker_id(role, index)
        logger.info("planner asked for a %s worker fewer: draining %s", role, name)
        self._spawn(self._drain(name))
        return self.count(role)

    async def _drain(self, name: str) -> None:
        try:
            code = await self.cluster.terminate(name, timeout_s=120.0)
            logger.info("%s drained (exit %s)", name, code)
        except Exception as err:  # still running after the wait: the cluster's stop SIGKILLs it
            logger.warning("%s did not exit after SIGTERM: %r", name, err)

    async def _watch_start(self, role: str, index: int, name: str) -> None:
        try:
            await self.cluster.wait_healthy([name], self.start_timeout_s)
        except Exception as err:  # it exited or never heartbeated: count it out
            logger.warning("%s did not start: %s", name, err)
            with contextlib.suppress(ValueError):
                self.indices[role].remove(index)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
