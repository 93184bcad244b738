"""Write-behind of dirty DRAM blocks: a durable block acknowledged in DRAM reaches the SSD within a bound.

``TieredBlockStore`` acknowledges a put once the blocks are in DRAM. Without write-behind a dirty block (durable
class, not yet on SSD) would reach the SSD only when LRU pressure pushes it out or at a clean close, so a SIGKILL
or OOM of the process would lose up to ``dram_bytes`` of acknowledged blocks. ``WriteBehind`` runs one task on
the store's event loop that, once woken by a newly dirty block, waits ``delay_s = write_behind_s / 2`` to gather
a batch and then calls the store's ``write`` coroutine, which writes every dirty block through the store's SSD
thread (never on the loop) in one batch.

Invariants:
- Bound: a block made dirty at ``t`` is on SSD by ``t + write_behind_s`` provided one batch write takes at most
  ``write_behind_s / 4`` (the pass in progress at ``t``, the gathering delay, then the pass that carries the
  block). A block on SSD survives a SIGKILL under every fsync policy (the write has returned from ``write(2)``);
  a power loss additionally needs ``fsync != "never"``. An SSD slower than that only delays the write; nothing
  is dropped.
- Bounded memory: there is no queue. The dirty blocks are DRAM entries (``DramEntry.on_ssd`` false, durable
  class), so what waits is bounded by ``dram_bytes``; a pass collects them from DRAM when it runs.
- Blocks of a class with ttl 0 (``none``, DRAM-only) are never collected (``dirty_entries``).
- A failed pass leaves the blocks dirty in DRAM (still served) and is retried after a backoff (doubling from
  ``delay_s`` up to ``MAX_BACKOFF_S``); the failure is logged and counted by the store.
- ``stop`` is idempotent; after it no pass starts (the store's close then flushes whatever is dirty).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from shared.errors import DeepinferError
from services.cache_tier.store.dram import DramEntry, DramTier

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


def dirty_entries(dram: DramTier, now: float) -> list[DramEntry]:
    """DRAM entries the SSD lacks: durable class, unexpired, not ``on_ssd`` (LRU first). O(entries)."""
    return [e for e in dram.entries() if not e.on_ssd and e.meta.is_durable and not e.meta.is_expired(now)]


class WriteBehind:
    """One background task per store; ``notify`` (on the loop) whenever a block becomes dirty.
    ``write_behind_s=None``: off (``notify`` does nothing)."""

    def __init__(self, write_behind_s: float | None, write: Callable[[], Awaitable[int]]) -> None:
        self.write_behind_s = write_behind_s
        self.delay_s = (write_behind_s or 0.0) / 2
        self._write = write              # writes every dirty block; returns how many; raises on SSD failure
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopped = write_behind_s is None
        self.passes = 0

    def notify(self) -> None:
        """A block became dirty: make sure a pass runs within ``delay_s`` (after the one in progress)."""
        if self._stopped:
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-store-write-behind")
        self._wake.set()

    async def _run(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(min(MAX_BACKOFF_S, self.delay_s * 2 ** min(failures, 16)))
            try:
                written = await self._write()
            except (DeepinferError, OSError) as exc:   # blocks stay dirty in DRAM: retry after a backoff
                failures += 1
                logger.error("block store: write-behind failed (attempt %d), retrying: %s", failures, exc)
                self._wake.set()
                continue
            failures = 0
            self.passes += 1
            logger.debug("block store: write-behind pass wrote %d blocks", written)

    async def stop(self) -> None:
        """Cancel the task (a pass in flight on the SSD thread still completes there). Idempotent."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
