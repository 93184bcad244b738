"""``TieredBlockStore``: the asyncio face of the block store, DRAM in front of SSD.

Use from one event loop. DRAM work runs on the loop (dict operations only); every SSD operation runs on one
dedicated thread (``ThreadPoolExecutor(max_workers=1)``), so file I/O never blocks the loop and SSD operations
are serialized in submission order; concurrent coroutines are safe.

Invariants:
- A held block is in DRAM, on SSD, or both (the DRAM entry is then ``on_ssd``: clean), or *in flight* to SSD
  (``_inflight``, still served). A get returns a block only if it is unexpired and its tokens, digest and
  model fingerprint equal the request's; every other outcome is a counted miss. A put of a block already held
  under the same identity never replaces its bytes (first writer wins: a later writer cannot swap the KV others
  are served); a put of another block under a hash already held (a 64-bit collision) replaces it: one block per
  hash, never a mix.
- Moves: a block pushed out of DRAM by LRU pressure is written back to SSD unless it is expired (dropped),
  DRAM-only (class ttl 0: dropped) or a clean copy of a record the SSD still holds (only its newer retention
  state is sent). An SSD hit is promoted into DRAM as a clean entry.
- Any hit or re-put extends the block's expiry (``RetentionPolicy.extend``); the SSD learns about DRAM-side
  extensions in batches (at most ``MAX_PENDING_TOUCHES`` waiting).
- Durability: ``put``/``put_many`` return once the blocks are in DRAM (or, if DRAM pushed them out, on SSD).
  With ``write_behind_s`` set, dirty durable blocks are written behind on the SSD thread (``WriteBehind``): a
  block acknowledged more than ``write_behind_s`` ago survives a SIGKILL while the SSD keeps up (a batch write
  within ``write_behind_s / 4``; ``fsync`` adds no delay, it decides power-loss safety); class ``none`` never
  reaches SSD. A durable block of the call itself that ends up in no tier (its SSD write failed) makes the call
  raise ``unavailable``; a write-back failure of *other* blocks it pushed out is logged and counted. ``flush``
  writes every dirty DRAM block and returns once durable, else raises ``unavailable``; ``close`` flushes first.
- Bounds: DRAM by ``dram_bytes``; SSD by ``ssd_bytes``; a call takes at most ``MAX_BATCH_BLOCKS`` blocks;
  at most ``MAX_PENDING_TOUCHES`` extensions wait on the loop side. Blocks in flight to SSD are those pushed
  out by calls still awaiting their write-back (each call waits for its own), so they are bounded by the
  callers' concurrency x batch size: the service bounds that with its request queue.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.errors import DeepinferError, ErrorCode
from shared.protocol_cache import MAX_TIER_BLOCKS
from services.cache_tier.store.block import StoredBlock, check_blocks, check_hash, check_identity, check_token_ids
from services.cache_tier.store.clock import Clock, SystemClock
from services.cache_tier.store.config import StoreConfig
from services.cache_tier.store.dram import DramEntry, DramTier
from shared.retention import BlockMeta
from services.cache_tier.store.ssd import SsdTier
from services.cache_tier.store.stats import GcReport, StoreStats
from services.cache_tier.store.write_behind import WriteBehind, dirty_entries

logger = logging.getLogger(__name__)

MAX_PENDING_TOUCHES = 1024
MAX_BATCH_BLOCKS = MAX_TIER_BLOCKS   # one put of the wire carries at most this many (shared/protocol_cache.py)


class TieredBlockStore:
    """Open with ``await TieredBlockStore.open(config, clock)``; close with ``await store.close()``."""

    def __init__(self, config: StoreConfig, clock: Clock, stats: StoreStats, ssd: SsdTier,
                 executor: ThreadPoolExecutor) -> None:
        self.config = config
        self._clock = clock
        self._stats = stats
        self._ssd = ssd
        self._executor = executor
        self._dram = DramTier(config.dram_bytes)
        self._inflight: dict[int, DramEntry] = {}
        self._touches: dict[int, BlockMeta] = {}   # DRAM-side extensions of blocks the SSD holds
        self._closed = False
        self._write_behind = WriteBehind(config.write_behind_s, self._write_dirty)   # off if None

    @classmethod
    async def open(cls, config: StoreConfig, clock: Clock | None = None) -> TieredBlockStore:
        """Open (or create) the store in ``config.directory``; the SSD index is rebuilt off the loop."""
        clock = clock or SystemClock()
        stats = StoreStats()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-ssd")
        try:
            ssd = await asyncio.get_running_loop().run_in_executor(executor, SsdTier, config, clock, stats)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(config, clock, stats, ssd, executor)

    async def __aenter__(self) -> TieredBlockStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_ssd(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def _check_open(self) -> None:
        if self._closed:
            raise DeepinferError(ErrorCode.UNAVAILABLE, "block store is closed")

    # -- writes -------------------------------------------------------------------------------------------
    async def put(self, block: StoredBlock, retention: str) -> None:
        await self.put_many([block], retention)

    async def put_many(self, blocks: Sequence[StoredBlock], retention: str) -> None:
        """Store blocks for a request of class ``retention`` (all validated first: all or nothing). A block
        already held under the same identity (hash, tokens, digest, build) keeps its first writer's bytes: the
        put only extends its life (other bytes of the same shape are counted in ``put_conflicts``, never
        stored; a block of the same identity with other rows, e.g. without its window layers', is not stored
        either). Raises
        ``invalid_request`` (bad types, unknown class) or ``payload_too_large``."""
        self._check_open()
        check_blocks(blocks, MAX_BATCH_BLOCKS, self.config.max_block_bytes)
        self.config.retention.ttl(retention)
        now = self._clock.now()
        pushed: list[DramEntry] = []
        dirty = False
        for block in blocks:
            meta = self.config.retention.new_meta(retention, now)
            old = self._dram.get(block.block_hash) or self._inflight.get(block.block_hash)
            if old is not None and not old.meta.is_expired(now) and old.block.same_identity(block):
                self._stats.put_conflicts += old.block.conflicts_with(block)
                old.meta.merge(meta)
                if old.on_ssd or block.block_hash in self._inflight:
                    self._touches[block.block_hash] = old.meta.copy()
                dirty |= old.meta.is_durable and not old.on_ssd
                continue
            if old is None and self._ssd.contains(block.block_hash):
                held = await self._on_ssd(self._ssd.get, block.block_hash, block.token_ids, retention,
                                          block.digest, block.fingerprint)  # a hit extends its life on SSD
                if held is not None:
                    self._stats.put_conflicts += held[0].conflicts_with(block)
                    continue
            pushed += self._dram.put(DramEntry(block, meta, on_ssd=False))
            dirty |= meta.is_durable
        if dirty:
            self._write_behind.notify()
        self._stats.dram_evictions += len(pushed)
        await self._write_back(pushed, now)
        if self.config.retention.ttl(retention) > 0:
            lost = [b.block_hash for b in blocks if self.where(b.block_hash) is None]
            if lost:   # pushed straight out of DRAM (write-through, or too big) and the SSD write failed
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"{len(lost)} of {len(blocks)} blocks could not be "
                                     "written to SSD")

    async def _write_back(self, entries: list[DramEntry], now: float, flushing: bool = False) -> list[int]:
        """Decide the fate of entries leaving DRAM (or flushed) and write the dirty ones in one SSD batch,
        with the pending extensions. ``flushing``: always go to the SSD, and raise on failure."""
        dirty = []
        for entry in entries:
            block_hash = entry.block.block_hash
            if entry.meta.is_expired(now):
                self._stats.dram_expiries += 1
            elif not entry.meta.is_durable:
                self._stats.dropped_dram_only += 1
            elif entry.on_ssd and self._ssd.contains(block_hash):
                self._touches[block_hash] = entry.meta.copy()
            else:
                dirty.append(entry)
                self._inflight[block_hash] = entry
        touches, self._touches = list(self._touches.items()), {}
        if not dirty and not flushing and len(touches) < MAX_PENDING_TOUCHES:
            self._touches = dict(touches)
            return []
        items = [(e.block, e.meta.copy()) for e in dirty]
        try:
            acked = await self._on_ssd(self._ssd_write, items, touches)
        except (OSError, DeepinferError) as exc:
            logger.error("block store: SSD write of %d blocks failed: %s", len(dirty), exc)
            self._stats.writeback_failures += len(dirty)
            if flushing:
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"block store SSD write failed: {exc}") from exc
            return []
        finally:
            for entry in dirty:
                if self._inflight.get(entry.block.block_hash) is entry:
                    del self._inflight[entry.block.block_hash]
        self._stats.writebacks += len(acked)
        return acked

    def _ssd_write(self, items: list[tuple[StoredBlock, BlockMeta]], touches: list[tuple[int, BlockMeta]]) \
            -> list[int]:
        self._ssd.touch_many(touches)
        return self._ssd.put_many(items)

    # -- reads --------------------------------------------------------------------------------------------
    async def get(self, block_hash: int, token_ids: Sequence[int], retention: str, digest: bytes = b"",
                  fingerprint: str = "") -> StoredBlock | None:
        """The block of ``block_hash`` holding exactly ``token_ids`` whose digest and model build are ``digest``
        and ``fingerprint`` (``StoredBlock.matches``), or None; a hit by a request of class ``retention`` extends
        its expiry. Raises ``invalid_request`` on a malformed argument."""
        self._check_open()
        check_hash(block_hash)
        token_ids = check_token_ids(token_ids)
        check_identity(digest, fingerprint)
        fresh = self.config.retention.new_meta(retention, self._clock.now())
        now = fresh.last_use
        entry = self._dram.get(block_hash) or self._inflight.get(block_hash)
        if entry is not None and entry.meta.is_expired(now):
            if self._dram.pop(block_hash) is not None:
                self._stats.dram_expiries += 1
            entry = None
        elif entry is not None and (miss := entry.block.mismatch(token_ids, digest, fingerprint)) is not None:
            self._stats.dram_token_mismatches += miss == "tokens"
            self._stats.dram_identity_mismatches += miss == "identity"
            entry = None
        if entry is not None:
            entry.meta.merge(fresh)
            if entry.meta.is_durable and not entry.on_ssd:
                self._write_behind.notify()     # a DRAM-only block upgraded by a durable-class hit
            self._stats.dram_hits += 1
            if entry.on_ssd or block_hash in self._inflight:
                self._touches[block_hash] = entry.meta.copy()
                if len(self._touches) >= MAX_PENDING_TOUCHES:
                    await self._write_back([], now)
            return entry.block
        self._stats.dram_misses += 1
        found = None
        if self._ssd.contains(block_hash):
            found = await self._on_ssd(self._ssd.get, block_hash, token_ids, retention, digest, fingerprint)
        if found is None:
            self._stats.ssd_misses += 1
            self._stats.misses += 1
            return None
        self._stats.ssd_hits += 1
        block, meta = found
        if block.nbytes <= self._dram.capacity_bytes:
            self._stats.promotions += 1
            pushed = self._dram.put(DramEntry(block, meta, on_ssd=True))
            self._stats.dram_evictions += len(pushed)
            await self._write_back(pushed, now)
        return block

    def where(self, block_hash: int) -> str | None:
        """``"dram"``, ``"ssd"`` or None: which tier holds the hash (a hint; no I/O, tokens not checked)."""
        check_hash(block_hash)
        if block_hash in self._dram or block_hash in self._inflight:
            return "dram"
        return "ssd" if self._ssd.contains(block_hash) else None

    async def hashes(self) -> set[int]:
        """Every block hash held in any tier now (expired ones GC has not removed yet included)."""
        self._check_open()
        on_ssd = await self._on_ssd(self._ssd.hashes)
        return set(on_ssd).union(self._dram.lru_order(), self._inflight)

    # -- maintenance --------------------------------------------------------------------------------------
    async def gc(self) -> GcReport:
        """Drop expired blocks from both tiers and compact mostly-dead segments."""
        self._check_open()
        expired = self._dram.pop_expired(self._clock.now())
        self._stats.dram_expiries += len(expired)
        touches, self._touches = list(self._touches.items()), {}
        ssd_expired, compacted = await self._on_ssd(self._ssd_gc, touches)
        return GcReport(len(expired), ssd_expired, compacted)

    def _ssd_gc(self, touches: list[tuple[int, BlockMeta]]) -> tuple[int, int]:
        self._ssd.touch_many(touches)
        return self._ssd.gc()

    async def flush(self) -> None:
        """Write every durable, unexpired DRAM block the SSD lacks, and pending extensions; return once durable.
        Raises ``unavailable`` if the SSD write fails."""
        self._check_open()
        await self._flush()

    async def _flush(self) -> None:
        now = self._clock.now()
        entries = [e for e in self._dram.entries() if e.meta.is_durable and not e.meta.is_expired(now)
                   and not (e.on_ssd and self._ssd.contains(e.block.block_hash))]
        for e in self._dram.entries():
            if e.on_ssd and e.meta.is_durable:
                self._touches[e.block.block_hash] = e.meta.copy()
        await self._write_durable(entries, now)
        try:
            await self._on_ssd(self._ssd.flush)
        except OSError as exc:
            raise DeepinferError(ErrorCode.UNAVAILABLE, f"block store SSD flush failed: {exc}") from exc

    async def _write_durable(self, entries: list[DramEntry], now: float) -> int:
        """Write DRAM entries (and pending extensions) in one SSD batch, mark the acked ones still in DRAM
        clean; the number acked. Raises ``unavailable`` on failure (the entries stay dirty)."""
        acked = set(await self._write_back(entries, now, flushing=True))
        for entry in entries:
            if entry.block.block_hash in acked and self._dram.peek(entry.block.block_hash) is entry:
                entry.on_ssd = True
        return len(acked)

    async def _write_dirty(self) -> int:
        """One write-behind pass: every dirty durable DRAM block to SSD (``WriteBehind`` calls it)."""
        now = self._clock.now()
        entries = [] if self._closed else dirty_entries(self._dram, now)
        written = await self._write_durable(entries, now) if entries else 0
        self._stats.write_behind_blocks += written
        return written

    async def close(self) -> None:
        """Flush, then close the SSD tier and its thread. Idempotent; a failed flush is logged, and the
        store is closed regardless."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._write_behind.stop()
            await self._flush()
        except (DeepinferError, OSError) as exc:
            logger.error("block store: flush at close failed: %s", exc)
        finally:
            await self._on_ssd(self._ssd.close)
            self._executor.shutdown(wait=False)

    def stats(self) -> dict[str, int | float]:
        """A snapshot of every counter and gauge (``StoreStats``)."""
        s = self._stats
        s.dram_bytes, s.dram_blocks = self._dram.bytes_used, len(self._dram)
        s.ssd_live_bytes, s.ssd_disk_bytes = self._ssd.live_bytes, self._ssd.disk_bytes
        s.ssd_blocks, s.ssd_segments = self._ssd.num_blocks, self._ssd.num_segments
        return s.as_dict()
