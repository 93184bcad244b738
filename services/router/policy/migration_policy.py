"""When to move a running stream to another decode worker (live migration), decided from heartbeats; the
router's ``Migrator`` carries the moves out. A pure function of its inputs, so a simulator can run it too.

Rules, in order:
1. **Drain**: every stream on a draining decode worker moves (it would otherwise be handed back and its whole
   context prefilled again elsewhere).
2. **KV pressure**: a decode worker whose KV pool is at least ``kv_high`` full is about to preempt by
   recompute; one stream per evaluation moves to a worker below ``kv_low``: of the least urgent ``priority``
   there (an SLO class's: batch streams move off a worker before interactive ones), the one with the most tokens
   left per token of context (the benefit, decode steps freed, over the cost, bytes moved).
3. **TPOT**: a decode worker whose step time (its streams' time per output token) exceeds ``tpot_slo_s`` moves
   one stream per evaluation, chosen as in 2, to a worker whose step time is under ``tpot_headroom`` of the SLO
   (``tpot_slo_s`` 0: rule off).
4. **Room for the urgent**: a decode worker that is full (its seats, ``max_num_seqs``, all taken, or its KV at
   ``kv_high``) while a stream placed there waits to start (``urgent``: the most urgent priority of those) moves
   one stream strictly less urgent than it (as in 2: least urgent first) to a worker with a free seat and KV below
   ``kv_low``, so the urgent stream starts where it was placed (its prefix may be cached there) and the other
   goes on elsewhere instead of being preempted.
5. **Skew**: a decode worker running at least ``skew_min`` more streams than the least loaded one and
   ``skew_ratio`` times as many (a worker that joined late, placements that ended unevenly) moves one stream
   per evaluation to it, chosen as in 2.

Bounds: at most ``per_source`` moves in flight out of one worker; never a stream that moved within
``cooldown_s`` (no ping-pong) nor one with fewer than ``min_tokens_left`` tokens to go (not worth its copy); a
target is alive, not draining and never the source. The target of each move is the least loaded candidate
(running + waiting, then KV usage), counting the moves already chosen.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MigrationConfig:
    kv_high: float = 0.9
    kv_low: float = 0.6
    cooldown_s: float = 10.0
    per_source: int = 2
    min_tokens_left: int = 16
    skew_min: int = 4       # rule 3 needs this many more running streams than the least loaded worker ...
    skew_ratio: float = 2.0  # ... and this many times as many (skew_min <= 0: rule 4 off)
    tpot_slo_s: float = 0.0  # rule 3: a worker stepping slower than this sheds streams (0 = off) ...
    tpot_headroom: float = 0.7  # ... to one stepping faster than this fraction of it
    urgent: bool = True  # rule 4 (the caller passes ``urgent`` only when this is on)


@dataclasses.dataclass(frozen=True)
class DecodeLoad:
    """One decode worker as the policy sees it."""
    worker_id: str
    running: int
    kv_usage: float
    draining: bool = False
    step_s: float = 0.0  # recent step time: seconds per output token of its streams (0 = idle / unknown)
    seats: int = 0       # its engine's max_num_seqs (0 = unknown: never full by seats)

    @property
    def seats_full(self) -> bool:
        return 0 < self.seats <= self.running


@dataclasses.dataclass(frozen=True)
class MovableStream:
    """One stream decoding on ``source``: its context (prompt + tokens so far) and tokens still to go."""
    request_id: str
    source: str
    context_tokens: int
    tokens_left: int
    moved_at: float | None = None  # when it last moved (monotonic seconds), None if never
    moving: bool = False
    priority: int = 0   # its request's (lower: more urgent; an SLO class shifts it)


def choose_moves(cfg: MigrationConfig, now: float, workers: list[DecodeLoad], streams: list[MovableStream],
                 in_flight: dict[str, int], urgent: dict[str, int] | None = None) -> list[tuple[str, str, str]]:
    """``(request id, target worker, reason)`` for each stream to move now (``reason``: ``drain``,
    ``kv_pressure``, ``tpot``, ``urgent`` or ``skew``); ``in_flight``: moves under way per source worker;
    ``urgent``: per decode worker, the most urgent priority of the streams placed there that have not started."""
    loads = {w.worker_id: [w.running, w.kv_usage] for w in workers if not w.draining}
    steps = {w.worker_id: w.step_s for w in workers}
    seats = {w.worker_id: w.seats for w in workers}
    busy = dict(in_flight)
    moves: list[tuple[str, str, str]] = []

    def target(source: str, kv_cap: float, step_cap: float, seat: bool = False) -> str | None:
        fits = [wid for wid, (n, kv) in loads.items() if wid != source and kv < kv_cap and steps[wid] < step_cap
                and not (seat and 0 < seats[wid] <= n)]
        if not fits:
            return None
        best = min(fits, key=lambda wid: (loads[wid][0], loads[wid][1], wid))
        loads[best][0] += 1
        return best

    def movable(s: MovableStream, drain: bool) -> bool:
        cooled = drain or s.moved_at is None or now - s.moved_at >= cfg.cooldown_s
        return (not s.moving and cooled and busy.get(s.source, 0) < cfg.per_source
                and s.tokens_left >= (1 if drain else cfg.min_tokens_left))

    by_worker = {w.worker_id: w for w in workers}
    for s in streams:                                           # 1. drain
        w = by_worker.get(s.source)
        if w is not None and w.draining and movable(s, drain=True):
            dest = target(s.source, kv_cap=1.0, step_cap=float("inf"))
            if dest is not None:
                moves.append((s.request_id, dest, "drain"))
                busy[s.source] = busy.get(s.source, 0) + 1
    chosen = {m[0] for m in moves}

    def relieve(source: str, kv_cap: float, reason: str, step_cap: float = float("inf"),
                less_urgent_than: int | None = None) -> None:
        mine = [s for s in streams if s.source == source and s.request_id not in chosen and movable(s, False)
                and (less_urgent_than is None or s.priority > less_urgent_than)]
        if not mine:
            return
        pick = max(mine, key=lambda s: (s.priority, s.tokens_left / max(1, s.context_tokens), s.request_id))
        dest = target(source, kv_cap, step_cap, seat=less_urgent_than is not None)
        if dest is not None:
            moves.append((pick.request_id, dest, reason))
            chosen.add(pick.request_id)
            busy[source] = busy.get(source, 0) + 1
            loads[source][0] -= 1

    for w in workers:                                           # 2. KV pressure, one stream per source
        if not w.draining and w.kv_usage >= cfg.kv_high:
            relieve(w.worker_id, cfg.kv_low, "kv_pressure")
    if cfg.tpot_slo_s > 0:                                      # 3. TPOT, one stream per source
        for w in workers:
            if not w.draining and w.step_s > cfg.tpot_slo_s:
                relieve(w.worker_id, cfg.kv_low, "tpot", step_cap=cfg.tpot_headroom * cfg.tpot_slo_s)
    for w in workers:                                           # 4. room for the urgent, one per source
        waiting = (urgent or {}).get(w.worker_id)
        moved_now = busy.get(w.worker_id, 0) > in_flight.get(w.worker_id, 0)   # rule 2 or 3 relieved it already
        if waiting is not None and not w.draining and not moved_now and (w.seats_full or w.kv_usage >= cfg.kv_high):
            relieve(w.worker_id, cfg.kv_low, "urgent", less_urgent_than=waiting)
    if cfg.skew_min > 0 and len(loads) >= 2:                    # 5. skew, one stream per source
        for w in sorted(workers, key=lambda w: -w.running):
            if w.draining or w.worker_id not in loads:
                continue
            least = min(n for wid, (n, _) in loads.items() if wid != w.worker_id)
            running = loads[w.worker_id][0]
            if running - least >= cfg.skew_min and running >= cfg.skew_ratio * max(1, least):
                relieve(w.worker_id, 1.0, "skew")
    return moves
