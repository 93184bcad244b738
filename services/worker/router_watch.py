"""A worker's watch on the routers that relay the streams it serves.

Work messages name the router relaying the stream and that router process's heartbeat ``instance``
(``router_id``, ``router_instance``). A router that dies takes its client streams with it, and no one will read
what the worker publishes: the worker stops such work instead of generating into a dead inbox until
``max_tokens`` (a router SIGKILL would otherwise hold every batch slot it had placed).

Invariants:
- a request is orphaned when its router has been silent for ``dead_after_s`` (counted from the latest of: its
  last heartbeat, the moment the watch began, the worker's own last reconnect: a worker that was cut off from
  NATS missed heartbeats, the router did not miss them), or at once when that router id heartbeats as another
  instance (restarted under the same id: the new process does not know the old streams);
- work that names no router (``router_id`` "") is never orphaned, nor is work of a router whose heartbeats
  could not be subscribed to;
- per router a single subscription, on its own heartbeat subject (``subjects.load``); subscriptions of routers
  no held request names are dropped, so their number stays bounded by the routers with work here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from shared import protocol, subjects

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Router:
    since: float                      # when the watch on it began
    last_seen: float = float("-inf")  # its last heartbeat
    instance: str = ""                # the instance of that heartbeat
    held: set[str] = field(default_factory=set)  # request ids here that it relays
    sub: object = None                # its NATS subscription


class RouterLiveness:
    """The bookkeeping, without NATS (``now`` is ``time.monotonic()``)."""

    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self.routers: dict[str, _Router] = {}
        self.requests: dict[str, tuple[str, str]] = {}  # request id -> (router id, router instance)
        self.reconnected_at = float("-inf")

    def hold(self, request_id: str, router_id: str, instance: str, now: float) -> _Router | None:
        """Watch ``request_id``; returns the router entry when it is new (its subscription is to be made)."""
        if not router_id:
            return None
        self.requests[request_id] = (router_id, instance)
        entry = self.routers.get(router_id)
        created = entry is None
        if created:
            entry = self.routers[router_id] = _Router(since=now)
        entry.held.add(request_id)
        return entry if created else None

    def release(self, request_id: str) -> _Router | None:
        """Stop watching ``request_id``; returns its router's entry when no held request names it any more."""
        router_id, _ = self.requests.pop(request_id, ("", ""))
        entry = self.routers.get(router_id)
        if entry is None:
            return None
        entry.held.discard(request_id)
        if entry.held:
            return None
        del self.routers[router_id]
        return entry

    def forget(self, router_id: str) -> None:
        """Stop watching ``router_id`` and every request it relays (its heartbeats cannot be followed)."""
        entry = self.routers.pop(router_id, None)
        for request_id in entry.held if entry is not None else ():
            self.requests.pop(request_id, None)

    def heartbeat(self, router_id: str, instance: str, now: float) -> None:
        entry = self.routers.get(router_id)
        if entry is not None:
            entry.last_seen, entry.instance = now, instance

    def orphans(self, now: float) -> list[str]:
        """Held requests whose router is gone (see the module's invariants)."""
        gone = []
        for request_id, (router_id, instance) in self.requests.items():
            entry = self.routers[router_id]
            silent_since = max(entry.last_seen, entry.since, self.reconnected_at)
            restarted = entry.instance != "" and entry.instance != instance
            if restarted or now - silent_since >= self.dead_after_s:
                gone.append(request_id)
        return gone


class RouterWatch:
    """``RouterLiveness`` fed by the routers' heartbeats over ``nc``; ``sweep`` returns the orphaned requests.
    ``spawn`` runs the unsubscriptions of routers no longer needed (``ServiceRuntime.spawn``)."""

    def __init__(self, nc, dead_after_s: float, spawn) -> None:
        self.nc, self.spawn = nc, spawn
        self.state = RouterLiveness(dead_after_s)

    async def hold(self, request_id: str, router_id: str, instance: str) -> None:
        entry = self.state.hold(request_id, router_id, instance, time.monotonic())
        if entry is None:
            return

        async def on_beat(msg) -> None:
            try:
                report = protocol.decode(msg.data, protocol.LoadReport)
            except Exception as err:  # noqa: BLE001 - a bad heartbeat is not this worker's problem
                logger.debug("undecodable heartbeat on %s: %s", msg.subject, err)
                return
            self.state.heartbeat(report.worker_id, report.instance, time.monotonic())
        try:
            entry.sub = await self.nc.subscribe(subjects.load(router_id, "router"), cb=on_beat,
                                                pending_msgs_limit=64)
        except BaseException as err:  # NATS trouble, or cancelled: unwatched work is never stopped by mistake
            if self.state.routers.get(router_id) is entry:
                self.state.forget(router_id)
            if not isinstance(err, Exception):
                raise
            logger.warning("cannot follow router %s's heartbeats (%s): its work here is not watched", router_id, err)
            return
        if self.state.routers.get(router_id) is not entry:  # released while subscribing
            self.spawn(self._unsubscribe(entry.sub))

    def release(self, request_id: str) -> None:
        entry = self.state.release(request_id)
        if entry is not None and entry.sub is not None:
            self.spawn(self._unsubscribe(entry.sub))

    @staticmethod
    async def _unsubscribe(sub) -> None:
        try:
            await sub.unsubscribe()
        except Exception as err:  # noqa: BLE001 - the connection is closing: nothing to undo
            logger.debug("unsubscribe from a router's heartbeats: %s", err)

    def reconnected(self) -> None:
        """This worker's NATS connection came back: heartbeats it missed are no router's fault."""
        self.state.reconnected_at = time.monotonic()

    def sweep(self) -> list[str]:
        return self.state.orphans(time.monotonic())
