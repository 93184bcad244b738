"""The router's live view of workers, fed by heartbeats on ``di.v1.*.*.load``.

A worker is alive while its last heartbeat is younger than ``dead_after_s``; new work is placed only on
alive workers that are not draining (a draining worker is still alive: the streams it finishes are watched
as usual). An entry dead for longer than ``forget_after_s`` is dropped by ``prune`` (restarted workers come
back under new ids, so the table would otherwise grow forever). Placement itself is the
policy's (``services/router/policy/`` via ``services/router/placement.py``).

A worker that was dead and heartbeats again (a host whose link came back, a worker whose NATS connection
resumed) takes new work only after ``rejoin_after_s`` of unbroken heartbeats: a connection that resumes after a
cut first delivers heartbeats it buffered, then is often dropped as stale and replaced, and work sent to it in
that window is lost (a hand-off then waits out its timeout). A worker seen for the first time takes work at once,
as does a restart under the same id (its heartbeat names another process ``instance``),
and so does one that beats within ``dead_after_s`` of a reconnect of the router's own connection
(``router_reconnected``): after a NATS restart the router missed every heartbeat, and the workers are not to blame.
When no worker of a role is past that wait, ``placeable`` offers the ones heartbeating now: a recovering worker
(its heartbeat was late on a loaded host) serves better than a refusal. ``known`` says a role has
workers that may come back (not yet forgotten): the relay waits a bounded time for them before answering
``unavailable``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from shared import protocol


@dataclass(slots=True)
class WorkerState:
    report: protocol.LoadReport
    last_seen: float
    since: float = 0.0  # start of its current run of heartbeats (each less than dead_after_s after the last)
    rejoined: bool = False  # the current run followed a silence of dead_after_s or more
    inflight: int = 0  # requests this router placed there that have not finished yet
    inflight_tokens: int = 0  # prompt tokens this router sent there to prefill, not finished yet


class WorkerTable:
    def __init__(self, dead_after_s: float, forget_after_s: float | None = None,
                 rejoin_after_s: float | None = None) -> None:
        self.dead_after_s = dead_after_s
        self.rejoin_after_s = dead_after_s if rejoin_after_s is None else rejoin_after_s
        self.forget_after_s = max(dead_after_s, forget_after_s if forget_after_s is not None else 10 * dead_after_s)
        self.workers: dict[str, WorkerState] = {}
        self.reconnected_at = float("-inf")  # when the router's own NATS connection last came back

    def router_reconnected(self, now: float | None = None) -> None:
        """The router's connection came back: silences that span this moment were the router's."""
        self.reconnected_at = time.monotonic() if now is None else now

    def update(self, report: protocol.LoadReport, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        state = self.workers.get(report.worker_id)
        if state is None:
            self.workers[report.worker_id] = WorkerState(report, now, since=now)
            return
        if report.instance != state.report.instance and report.instance:   # a restarted process: new, not back
            state.since, state.rejoined = now, False
        elif now - state.last_seen >= self.dead_after_s:  # back after a silence: a new run starts
            # the router itself saw only the silence since it was last connected
            state.since, state.rejoined = now, now - max(state.last_seen, self.reconnected_at) >= self.dead_after_s
        state.report, state.last_seen = report, now

    def is_alive(self, worker_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        state = self.workers.get(worker_id)
        return state is not None and now - state.last_seen < self.dead_after_s

    def alive(self, role: str, now: float | None = None) -> list[WorkerState]:
        """Workers of ``role`` that take new work: heartbeating and not draining."""
        now = time.monotonic() if now is None else now
        return [s for s in self.workers.values()
                if s.report.role == role and not s.report.draining and now - s.last_seen < self.dead_after_s
                and (not s.rejoined or now - s.since >= self.rejoin_after_s)]

    def placeable(self, role: str, now: float | None = None) -> list[WorkerState]:
        """``alive(role)``, or when that is empty the workers of ``role`` heartbeating now and not draining
        (those still inside their rejoin wait)."""
        now = time.monotonic() if now is None else now
        return self.alive(role, now) or [s for s in self.workers.values() if s.report.role == role
                                         and not s.report.draining and now - s.last_seen < self.dead_after_s]

    def known(self, role: str) -> bool:
        """Whether the table holds a worker of ``role`` that is not draining (alive or silent, not forgotten)."""
        return any(s.report.role == role and not s.report.draining for s in self.workers.values())

    def prune(self, now: float | None = None) -> list[str]:
        """Drop workers silent for longer than ``forget_after_s``; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = [wid for wid, s in self.workers.items() if now - s.last_seen >= self.forget_after_s]
        for wid in gone:
            del self.workers[wid]
        return gone



class InflightAccount:
    """Load this router placed on workers that their heartbeats may not show yet: one request on each placed
    worker until it ends, and its prompt tokens on the worker computing them until the first token.
    ``prefill_done`` and ``close`` are idempotent."""

    def __init__(self, prefill: WorkerState | None, decode: WorkerState, prompt_tokens: int) -> None:
        self.placed = [w for w in (prefill, decode) if w is not None]
        self.prefilling = prefill or decode
        for w in self.placed:
            w.inflight += 1
        self.pending_tokens = prompt_tokens
        self.prefilling.inflight_tokens += prompt_tokens

    def prefill_done(self) -> None:
        self.prefilling.inflight_tokens -= self.pending_tokens
        self.pending_tokens = 0

    def move(self, old: WorkerState, new: WorkerState) -> None:
        """The request now runs on ``new`` instead of ``old`` (a live migration)."""
        if old in self.placed:
            self.placed.remove(old)
            old.inflight -= 1
            self.placed.append(new)
            new.inflight += 1

    def close(self) -> None:
        self.prefill_done()
        for w in self.placed:
            w.inflight -= 1
        self.placed = []
