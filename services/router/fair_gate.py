"""Fair admission between tenants at the router's door.

A router sends workers at most ``window()`` requests at once (by default the decode workers' batch capacity,
``max_num_seqs`` from their heartbeats: more would only queue FIFO inside the engines, where a flooding
tenant's backlog sits in front of everyone else's). Beyond the window, requests wait here, one FIFO per tenant,
and a freed slot goes to the waiting request with the smallest start tag (start-time fair queueing): tenant
``t``'s next request starts at ``max(now_tag, previous start + 1 / weight[t])``, ``now_tag`` being the start tag
last dispatched, so every tenant with work waiting gets slots in proportion to its weight, whatever the others
have queued, and a tenant that arrives while another floods is served next, not after the flood. Requests carry
a ``priority`` (vLLM's integer, lower first; an SLO class shifts it: ``shared/slo_classes.py``): a freed slot goes
to the most urgent priority waiting, and among those by start tag, so classes come first and tenants share fairly
within a class.

Urgent work does not wait for less urgent streams to end: a request may dispatch beyond the window while fewer
than ``window`` requests as urgent as it or more are dispatched (at most ``2 * window`` in all); the engines'
``priority`` scheduling then preempts a less urgent sequence for it (recomputed later, exact). And when the router
is full (``max_inflight``), an arrival sheds the least urgent request still waiting here if that one is less
urgent than it (``shed_for``: the shed one is answered ``overloaded``, HTTP 429 with Retry-After, never dropped);
so does a tenant at its limit, among its own waiting requests.

Headroom for newcomers: the gate cannot preempt, so once one tenant's long streams fill the window, another
tenant would wait for one of them to end (seconds to minutes). While two or more tenants have been active within
``recent_s``, the last ``floor(window * headroom)`` slots (none for a window below 8) go only to a tenant below
its weighted share of the window; a tenant alone (the plain API, a single-tenant deployment) uses the whole
window.

Invariants: a tenant holds at most ``tenant_max`` requests (dispatched + waiting; beyond: ``overloaded``, HTTP 429
with Retry-After); dispatched never exceeds the window while it is known, but for requests more urgent than some
dispatched one, and never ``2 * window`` (None = unknown or unlimited: no
waiting, the pre-gate behaviour, so a cluster without decode workers still fails fast with ``unavailable``);
a waiter that is cancelled or whose deadline passes leaves the queue and takes no slot. The plain API (no
tenant) is one tenant, ``""``.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Callable

from shared.errors import DeepinferError, ErrorCode

PUMP_S = 1.0  # waiters re-check the window this often (it grows when decode workers join)
HEADROOM = 0.125  # share of the window kept for tenants below their share while several are active
RECENT_S = 30.0   # a tenant counts as active this long after its last request arrived


class TenantLimit(DeepinferError):
    """``overloaded``: the tenant already holds ``tenant_max`` requests here."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, message)


class Shed(DeepinferError):
    """``overloaded``: a waiting request refused to make room for a more urgent one (the router was full)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OVERLOADED, message)


def may_overcommit(dispatched_at: dict[int, int], window: int, priority: int) -> bool:
    """Whether a request of ``priority`` may dispatch beyond a full ``window`` (``dispatched_at``: priority ->
    requests dispatched): fewer than ``window`` as urgent or more are dispatched, some less urgent one is (an
    engine takes its seat back), and fewer than ``2 * window`` in all. The simulator's gate uses it too."""
    dispatched = sum(dispatched_at.values())
    urgent = sum(n for p, n in dispatched_at.items() if p <= priority)
    return urgent < window and dispatched < 2 * window and urgent < dispatched


class FairGate:
    def __init__(self, window: Callable[[], int | None], tenant_max: int,
                 weights: dict[str, float] | None = None, headroom: float = HEADROOM,
                 recent_s: float = RECENT_S) -> None:
        self.window, self.tenant_max, self.weights = window, tenant_max, weights or {}
        self.headroom, self.recent_s = headroom, recent_s
        self.dispatched = 0
        self.dispatched_by: dict[str, int] = {}   # tenant -> its requests on workers now
        self.dispatched_at: dict[int, int] = {}   # priority -> requests of it on workers now
        self.held: dict[str, int] = {}            # tenant -> its requests here (dispatched + waiting)
        self._seen: dict[str, float] = {}         # tenant -> when its latest request arrived (monotonic)
        self._finish: dict[str, float] = {}       # tenant -> where its next request's tag starts
        self._now_tag = 0.0                       # start tag of the latest dispatched request
        self._waiting: list[tuple[int, float, int, str, asyncio.Future]] = []  # (priority, tag, arrival, tenant, fut)
        self._order = itertools.count()
        self._shed: dict[str, int] = {}           # tenant -> its shed requests not yet gone (held still counts them)

    @property
    def num_waiting(self) -> int:
        return sum(1 for *_, fut in self._waiting if not fut.done())

    def _tag(self, tenant: str) -> float:
        """The request's start tag; the tenant's next one starts ``1 / weight`` later."""
        start = max(self._now_tag, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + 1.0 / self.weights.get(tenant, 1.0)
        return start

    def _may_dispatch(self, tenant: str, priority: int = 0) -> bool:
        """Whether a request of ``tenant`` may take a slot now (the window, and its headroom for newcomers; beyond
        the window, one more urgent than some dispatched request while fewer than ``window`` as urgent are)."""
        window = self.window()
        if window is None:
            return True
        if self.dispatched >= window:
            return may_overcommit(self.dispatched_at, window, priority)
        now = time.monotonic()
        active = [t for t, seen in self._seen.items() if now - seen < self.recent_s or self.held.get(t)]
        if len(active) < 2 or self.dispatched < window - math.floor(window * self.headroom):
            return True
        share = window * self.weights.get(tenant, 1.0) / sum(self.weights.get(t, 1.0) for t in active)
        return self.dispatched_by.get(tenant, 0) < share

    def _grant(self, tenant: str, tag: float, priority: int) -> None:
        self.dispatched += 1
        self.dispatched_by[tenant] = self.dispatched_by.get(tenant, 0) + 1
        self.dispatched_at[priority] = self.dispatched_at.get(priority, 0) + 1
        self._now_tag = max(self._now_tag, tag)

    def _pump(self) -> None:
        """Hand free slots to the waiters with the smallest tags that may take them."""
        waiting = sorted((w for w in self._waiting if not w[4].done()),   # drops the cancelled and timed out
                         key=lambda w: w[:3])
        self._waiting = []
        for i, (priority, tag, order, tenant, fut) in enumerate(waiting):
            if not self._may_dispatch(tenant, priority) and self._full(priority):
                self._waiting += waiting[i:]   # no later (less urgent) waiter fits either
                break
            if self._may_dispatch(tenant, priority):
                self._grant(tenant, tag, priority)
                fut.set_result(None)
            else:
                self._waiting.append((priority, tag, order, tenant, fut))  # headroom: a later tenant may fit

    def _full(self, priority: int) -> bool:
        """Whether no request of ``priority`` or less urgent may take a slot, whatever its tenant."""
        window = self.window()
        return window is not None and self.dispatched >= window and not self._may_dispatch("", priority)

    def shed_for(self, priority: int, tenant: str | None = None) -> bool:
        """Refuse the least urgent waiting request (the latest of its priority; ``tenant``'s only when given) if it
        is less urgent than ``priority``: it leaves with ``Shed`` and no longer counts against its tenant's limit.
        Whether one was shed."""
        live = [w for w in self._waiting if not w[4].done() and (tenant is None or w[3] == tenant)]
        if not live:
            return False
        victim = max(live, key=lambda w: (w[0], w[2]))
        if victim[0] <= priority:
            return False
        victim[4].set_exception(Shed("shed to make room for a more urgent request; retry later"))
        self._shed[victim[3]] = self._shed.get(victim[3], 0) + 1
        return True

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, deadline: float, priority: int = 0):
        """Hold a dispatch slot for ``tenant`` while the block runs; waits for one (at most until ``deadline``,
        a ``time.monotonic()`` instant like ``Stream.deadline``: then ``timeout``), before every waiter of a
        larger ``priority`` value."""
        held = self.held.get(tenant, 0)
        if held - self._shed.get(tenant, 0) >= self.tenant_max and not self.shed_for(priority, tenant):
            raise TenantLimit(f"tenant {tenant or '(plain API)'} has {held} requests in flight (limit "
                              f"{self.tenant_max}); retry later")
        self.held[tenant] = held + 1
        self._seen[tenant] = time.monotonic()
        granted = False
        try:
            tag = self._tag(tenant)
            ahead = any(w[0] <= priority and not w[4].done() for w in self._waiting)
            if not ahead and self._may_dispatch(tenant, priority):
                self._grant(tenant, tag, priority)
                granted = True
            else:
                granted = await self._wait(tenant, tag, deadline, priority)
            yield
        except Shed:
            self._shed[tenant] -= 1
            if not self._shed[tenant]:
                del self._shed[tenant]
            raise
        finally:
            if granted:
                self._release(tenant, priority)
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]
                self._finish.pop(tenant, None)
            self._forget_idle()
            self._pump()

    def _release(self, tenant: str, priority: int) -> None:
        self.dispatched -= 1
        self.dispatched_by[tenant] -= 1
        if not self.dispatched_by[tenant]:
            del self.dispatched_by[tenant]
        self.dispatched_at[priority] -= 1
        if not self.dispatched_at[priority]:
            del self.dispatched_at[priority]

    def _forget_idle(self) -> None:
        """Drop tenants neither holding requests nor seen within ``recent_s`` (bounds ``_seen``)."""
        now = time.monotonic()
        for t in [t for t, seen in self._seen.items() if now - seen >= self.recent_s and not self.held.get(t)]:
            del self._seen[t]

    async def _wait(self, tenant: str, tag: float, deadline: float, priority: int) -> bool:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((priority, tag, next(self._order), tenant, fut))
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
            if fut.done() and not fut.cancelled() and fut.exception() is None:   # granted in the same instant
                self._release(tenant, priority)
            else:
                fut.cancel()
            raise
