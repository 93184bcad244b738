"""A worker that serves prefill or decode and switches between them on the P:D planner's order, without
reloading its model: ``ctl(<id>, "role")`` with a ``RoleSwitch``.

A switch is a drain that does not close: withdraw (a draining heartbeat: the router places nothing new here and,
with ``migrate_on_drain``, live-migrates the decode streams away), let in-flight work finish for up to
``drain_grace_s`` and hand back the rest (as at shutdown), unsubscribe the old role's work subjects, subscribe
the new role's, and heartbeat under the new role. The engine, its KV pool and its prefix cache stay: blocks cached
as a prefill worker serve prefix hits as a decode worker (local prefill) and the other way round.

Invariants: one switch at a time (a second order waits for the first; one for the current role is answered at
once); nothing in flight when the old role's subjects are dropped; a switch ordered during shutdown, or a
shutdown during a switch, leaves the worker draining (it never serves again once shutting down); the reply comes
only once the new role is served.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from services.decode.service import DecodeService
from services.prefill.service import PrefillService
from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode

logger = logging.getLogger(__name__)


class SwitchableWorker(DecodeService, PrefillService):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.role_switches = 0
        self._role_subs: list = []
        self._switch_lock: asyncio.Lock | None = None

    async def serve_handlers(self) -> list:
        self._switch_lock = asyncio.Lock()
        self._role_subs = await self._serve_role()
        await self.runtime.serve(subjects.ctl(self.config.worker_id, "role"), self.on_role, work=False)
        return self._role_subs

    async def _serve_role(self) -> list:
        role_cls = DecodeService if self.config.role == "decode" else PrefillService
        return await role_cls.serve_handlers(self)

    async def on_role(self, msg) -> None:
        order = protocol.decode(msg.data, protocol.RoleSwitch)
        await self.switch_role(order.role)
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(detail=order.role)))

    async def switch_role(self, role: str) -> None:
        """Drain, then serve ``role`` (see the module docstring); raises ``unavailable`` while shutting down."""
        async with self._switch_lock:
            c, rt = self.config, self.runtime
            if role == c.role:
                return
            if self._shutdown is not None or rt.draining:
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"{c.worker_id} is shutting down")
            logger.info("%s: switching %s -> %s (%d in flight)", c.worker_id, c.role, role, rt.num_inflight)
            await rt.withdraw()
            await rt.finish_inflight(c.drain_grace_s, self.hand_back)
            if self._shutdown is not None:  # SIGTERM meanwhile: the shutdown owns the rest
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"{c.worker_id} is shutting down")
            for sub in self._role_subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            self._handing_back = False
            self.config = dataclasses.replace(c, role=role)
            try:
                self._role_subs = await self._serve_role()
            except BaseException:  # serve the old role again: never left draining with nothing subscribed
                self.config = c
                self._role_subs = await self._serve_role()
                if self._shutdown is None:
                    await rt.rejoin(rt.info)
                raise
            if self._shutdown is not None:  # SIGTERM during the subscribes: stay draining (no await until rejoin)
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"{c.worker_id} is shutting down")
            self.role_switches += 1
            await rt.rejoin(dataclasses.replace(rt.info, role=role))
            logger.info("%s: serving %s", c.worker_id, role)
