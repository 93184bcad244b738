"""Publishes a worker's prefix-cache changes as ``KVEvent``s on ``di.v1.kv.<worker>.events`` and answers snapshot
requests, so the router's KV index knows which blocks live where.

The engine thread calls ``sink`` (via the block manager); a bounded deque carries events to the event
loop, which publishes them every ``flush_s`` with per-worker sequence numbers 1, 2, 3, ... When the deque
overflows, events are dropped and the next published seq skips one: the index sees a gap and resyncs from
a snapshot, so it is never silently wrong.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading

from shared import protocol, subjects

logger = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(self, nc, worker_id: str, snapshot_fn, max_pending: int = 65536, flush_s: float = 0.05,
                 tier: str = "device") -> None:
        """``tier``: the KV tier every event and snapshot names (a worker's ``device`` pool; ``cache_tier``)."""
        self.nc, self.worker_id, self.snapshot_fn, self.tier = nc, worker_id, snapshot_fn, tier
        self.flush_s = flush_s
        self.seq = 0
        self._pending: collections.deque[tuple[str, list[int]]] = collections.deque()
        self._max_pending = max_pending
        self._lost = False
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None

    def sink(self, kind: str, hashes: list[int]) -> None:
        """Called on the engine thread: queue one change (never blocks)."""
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self._lost = True
                return
            self._pending.append((kind, list(hashes)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Publish what is queued (best effort), then stop the flush loop. Idempotent."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
            try:
                await asyncio.wait_for(self.flush(), 1.0)
            except Exception as err:  # NATS down: the router resyncs or forgets this worker anyway
                logger.debug("kv events not flushed at stop: %s", err)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await self.flush()
            except Exception as err:  # NATS down: the events were requeued, retry next tick
                logger.debug("kv events not published: %s", err)

    async def flush(self) -> None:
        """Publish everything queued. A publish that fails puts the unpublished changes back at the front of
        the queue (their seqs are reused next time); if that overflows the queue, they are dropped and the
        next published seq skips one, so the index resyncs."""
        with self._lock:
            batch, self._pending = self._pending, collections.deque()
            lost, self._lost = self._lost, False
        if lost:
            self.seq += 1  # a deliberate gap: the index must resync
        events = list(_coalesce(batch))
        for i, (kind, hashes) in enumerate(events):
            event = protocol.KVEvent(worker_id=self.worker_id, seq=self.seq + 1, kind=kind, block_hashes=hashes,
                                     tier=self.tier)
            try:
                await self.nc.publish(subjects.kv_events(self.worker_id), protocol.encode(event))
            except BaseException:
                self._requeue(events[i:])
                raise
            self.seq += 1

    def _requeue(self, unsent: list[tuple[str, list[int]]]) -> None:
        with self._lock:
            if len(self._pending) + len(unsent) > self._max_pending:
                self._pending.clear()
                self._lost = True
            else:
                self._pending.extendleft(reversed(unsent))

    async def on_snapshot(self, msg) -> None:
        """Reply with every cached hash as of the last published seq (flushes pending events first)."""
        if not msg.reply:
            return  # nobody to answer: not worth a snapshot
        await self.flush()
        hashes = await self.snapshot_fn()
        await msg.respond(protocol.encode(protocol.KVSnapshot(worker_id=self.worker_id, seq=self.seq,
                                                              block_hashes=hashes, tier=self.tier)))


def _coalesce(batch, max_hashes: int = 4096):
    """Merge consecutive changes of the same kind into events of at most ``max_hashes`` hashes."""
    kind, hashes = None, []
    for k, h in batch:
        if k != kind or len(hashes) + len(h) > max_hashes or k == "cleared":
            if kind is not None:
                yield kind, hashes
            kind, hashes = k, []
        hashes.extend(h)
    if kind is not None:
        yield kind, hashes
