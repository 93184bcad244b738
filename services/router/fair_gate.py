"""Fair admission between tenants at the router's door.

A router sends workers at most ``window()`` requests at once (by default the decode workers' batch capacity,
``max_num_seqs`` from their heartbeats: more would only queue FIFO inside the engines, where a flooding
tenant's backlog sits in front of everyone else's). Beyond the window, requests wait here, one FIFO per tenant,
and a freed slot goes to the waiting request with the smallest start tag (start-time fair queueing): tenant
``t``'s next request starts at ``max(now_tag, previous start + 1 / weight[t])``, ``now_tag`` being the start tag
last dispatched, so every tenant with work waiting gets slots in proportion to its weight, whatever the others
have queued, and a tenant that arrives while another floods is served next, not after the flood.

Invariants: a tenant holds at most ``tenant_max`` requests (dispatched + waiting; beyond: ``overloaded``, HTTP 429
with Retry-After); dispatched never exceeds the window while it is known (None = unknown or unlimited: no
waiting, the pre-gate behaviour, so a cluster without decode workers still fails fast with ``unavailable``);
a waiter that is cancelled or whose deadline passes leaves the queue and takes no slot. The plain API (no
tenant) is one tenant, ``""``.
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable

from shared.errors import DeepinferError, ErrorCode

PUMP_S = 1.0  # waiters re-check the window this often (it grows when decode workers join)


class TenantLimit(DeepinferError):
    """``overloaded``: the tenant already holds ``tenant_max`` requests here."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, message)


class FairGate:
    def __init__(self, window: Callable[[], int | None], tenant_max: int,
                 weights: dict[str, float] | None = None) -> None:
        self.window, self.tenant_max, self.weights = window, tenant_max, weights or {}
        self.dispatched = 0
        self.held: dict[str, int] = {}            # tenant -> its requests here (dispatched + waiting)
        self._finish: dict[str, float] = {}       # tenant -> where its next request's tag starts
        self._now_tag = 0.0                       # start tag of the latest dispatched request
        self._waiting: list[tuple[float, int, asyncio.Future]] = []  # heap of (tag, arrival, future)
        self._order = itertools.count()

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, fut in self._waiting if not fut.done())

    def _tag(self, tenant: str) -> float:
        """The request's start tag; the tenant's next one starts ``1 / weight`` later."""
        start = max(self._now_tag, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + 1.0 / self.weights.get(tenant, 1.0)
        return start

    def _room(self) -> bool:
        window = self.window()
        return window is None or self.dispatched < window

    def _pump(self) -> None:
        """Hand free slots to the waiters with the smallest tags."""
        while self._waiting and self._room():
            tag, _, fut = heapq.heappop(self._waiting)
            if fut.done():  # cancelled or timed out while waiting
                continue
            self.dispatched += 1
            self._now_tag = max(self._now_tag, tag)
            fut.set_result(None)

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, deadline: float):
        """Hold a dispatch slot for ``tenant`` while the block runs; waits for one (at most until ``deadline``,
        a ``time.monotonic()`` instant like ``Stream.deadline``: then ``timeout``)."""
        held = self.held.get(tenant, 0)
        if held >= self.tenant_max:
            raise TenantLimit(f"tenant {tenant or '(plain API)'} has {held} requests in flight (limit "
                              f"{self.tenant_max}); retry later")
        self.held[tenant] = held + 1
        granted = False
        try:
            tag = self._tag(tenant)
            if not self._waiting and self._room():
                self.dispatched += 1
                self._now_tag = max(self._now_tag, tag)
                granted = True
            else:
                granted = await self._wait(tag, deadline)
            yield
        finally:
            if granted:
                self.dispatched -= 1
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]
                self._finish.pop(tenant, None)
            self._pump()

    async def _wait(self, tag: float, deadline: float) -> bool:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (tag, next(self._order), fut))
        try:
            while not fut.done():
                self._pump()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeepinferError(ErrorCode.TIMEOUT, "the request's deadline passed while it waited for "
                                         "a dispatch slot")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(fut), min(PUMP_S, left))
            return True
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted in the same instant: give the slot back
                self.dispatched -= 1
            else:
                fut.cancel()
            raise
