"""The cluster simulator's shared cache tier: the block store's model (``services/cache_tier/store``) in block counts.

DRAM (LRU, ``dram_blocks``) in front of SSD (``ssd_blocks``); blocks are trace hash ids, time is the
simulator's clock, ttls come from ``shared.retention.RetentionPolicy``. As ``TieredBlockStore``:

- ``put``: a block enters DRAM as the most recent (a block already held keeps the later expiry). What DRAM
  pushes out, least recent first, is written back to SSD unless it is expired or DRAM-only (class ttl 0, e.g.
  ``none``: dropped). ``dram_blocks == 0`` is write-through: a put goes straight to SSD.
- ``use`` (a hit): ``expiry = max(expiry, now + ttl(class))``, last use = now; an SSD hit is promoted into
  DRAM (the SSD keeps its copy: the store's clean DRAM entry), a DRAM hit becomes the most recent.
- A block with ``0 < expiry <= now`` is expired: never served; a lookup that meets it removes it everywhere.
- A full SSD drops blocks in ``(expiry, last_use)`` order (expired ones first, then soonest expiry, then least
  recently used; ties: the earliest written).

Invariants: ``len(dram) <= dram_blocks``; ``len(ssd) <= ssd_blocks``; every SSD block is durable
(expiry > 0). A block held by both tiers has ONE ``BlockMeta`` object: an extension reaches both at once
(the store hands DRAM-side extensions to its SSD index in batches, so its SSD eviction order may lag
slightly). Every SSD block has a heap entry keyed at most its current key. Not modelled: the store's
periodic GC (expired blocks are dropped when met or under capacity pressure instead; either way they are
never served), byte sizes (all blocks of a trace are one size), segment compaction.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from shared.retention import BlockMeta, RetentionPolicy
from services.cache_tier.store.stats import StoreStats

DRAM, SSD = "dram", "ssd"


@dataclass(frozen=True, slots=True)
class TierPrefix:
    """The leading blocks of a prompt the tier holds: ``sources[i]`` is the tier block ``i`` would come from."""

    sources: tuple[str, ...]
    dram_block_s: float
    ssd_block_s: float

    @property
    def blocks(self) -> int:
        return len(self.sources)

    def counts(self, start: int = 0) -> dict[str, int]:
        """Blocks from each tier among ``sources[start:]`` (the part a worker holding ``start`` blocks pulls)."""
        ssd = self.sources[start:].count(SSD)
        return {DRAM: max(0, self.blocks - start) - ssd, SSD: ssd}

    def pull_s(self, start: int = 0) -> float:
        """Seconds to pull ``sources[start:]`` to a worker at the two tiers' bandwidths."""
        n = self.counts(start)
        return n[DRAM] * self.dram_block_s + n[SSD] * self.ssd_block_s

    def tokens(self, start: int, num_tokens: int, block_size: int) -> dict[str, int]:
        """Prompt tokens in ``sources[start:]`` per tier, for a prompt of ``num_tokens`` (the last block may
        be partial)."""
        out = {DRAM: 0, SSD: 0}
        for i in range(start, self.blocks):
            out[self.sources[i]] += max(0, min(block_size, num_tokens - i * block_size))
        return out

    def block_s(self) -> float | None:
        """Mean pull cost of one block of the whole prefix (None when the tier holds none)."""
        return self.pull_s() / self.blocks if self.blocks else None


class SimTier:
    """Counters in ``stats`` use ``StoreStats``'s names (hits per block; a lookup's first absent block is
    not counted as a miss)."""

    def __init__(self, dram_blocks: int, ssd_blocks: int, retention: RetentionPolicy, dram_block_s: float,
                 ssd_block_s: float) -> None:
        if dram_blocks < 0 or ssd_blocks < 0:
            raise ValueError(f"tier capacities must be >= 0 blocks, got dram={dram_blocks} ssd={ssd_blocks}")
        if dram_block_s < 0 or ssd_block_s < 0:
            raise ValueError("pull times must be >= 0")
        self.dram_blocks, self.ssd_blocks = dram_blocks, ssd_blocks
        self.retention = retention
        self.dram_block_s, self.ssd_block_s = dram_block_s, ssd_block_s
        self.dram: OrderedDict[int, BlockMeta] = OrderedDict()  # least recently used first
        self.ssd: dict[int, BlockMeta] = {}
        self._order: dict[int, int] = {}  # SSD block -> write order (ties of the eviction key)
        self._heap: list[tuple[float, float, int, int]] = []  # (expiry, last_use, order, hash), lazily updated
        self._seq = 0
        self.stats = StoreStats()

    @property
    def enabled(self) -> bool:
        return self.dram_blocks > 0 or self.ssd_blocks > 0

    # -- lookups ------------------------------------------------------------------------------------------
    def where(self, h: int, now: float) -> str | None:
        """``"dram"``, ``"ssd"`` or None; an expired block is removed from both tiers and is None."""
        meta = self.dram.get(h) or self.ssd.get(h)
        if meta is None:
            return None
        if meta.is_expired(now):
            if self.dram.pop(h, None) is not None:
                self.stats.dram_expiries += 1
            if self.ssd.pop(h, None) is not None:
                del self._order[h]
                self.stats.ssd_expiries += 1
            return None
        return DRAM if h in self.dram else SSD

    def prefix(self, hashes: tuple[int, ...], now: float) -> TierPrefix:
        """The leading blocks of ``hashes`` held unexpired, and where each would be pulled from."""
        sources = []
        for h in hashes:
            src = self.where(h, now)
            if src is None:
                break
            sources.append(src)
        return TierPrefix(tuple(sources), self.dram_block_s, self.ssd_block_s)

    # -- hits and writes ----------------------------------------------------------------------------------
    def use(self, hashes: tuple[int, ...], retention: str, now: float) -> dict[str, int]:
        """A request of class ``retention`` pulled ``hashes`` (all held: take them from ``prefix``) as one
        batch: each is read where it is now and extended; then, in order, a DRAM hit becomes the most recent
        and an SSD hit is promoted (which may push blocks of this batch out of DRAM: they were read already).
        Returns the blocks served by each tier."""
        sources = []
        for h in hashes:
            src = self.where(h, now)
            if src is None:
                raise KeyError(f"block {h} is not held by the tier")
            sources.append(src)
            self.retention.extend(self.dram[h] if src == DRAM else self.ssd[h], retention, now)
        for h, src in zip(hashes, sources):
            if src == DRAM:
                self.stats.dram_hits += 1
                if h in self.dram:
                    self.dram.move_to_end(h)
            else:
                self.stats.ssd_hits += 1
                if self.dram_blocks and h in self.ssd:
                    self.stats.promotions += 1
                    self._dram_put(h, self.ssd[h], now)
        return {DRAM: sources.count(DRAM), SSD: sources.count(SSD)}

    def put(self, hashes: tuple[int, ...], retention: str, now: float) -> None:
        """Store ``hashes`` for a request of class ``retention``, in the given order (the last put is the
        most recent: put a prompt's blocks tail first so its head outlives its tail)."""
        for h in hashes:
            self.where(h, now)  # an expired copy is dropped: the put starts a fresh life
            meta = self.dram.get(h) or self.ssd.get(h)
            if meta is None:
                meta = self.retention.new_meta(retention, now)
            else:
                self.retention.extend(meta, retention, now)
            if self.dram_blocks:
                self._dram_put(h, meta, now)
            elif not meta.is_durable:  # write-through of a DRAM-only block: dropped
                self.stats.dropped_dram_only += 1
            else:
                self._ssd_put(h, meta, now)

    # -- moves --------------------------------------------------------------------------------------------
    def _dram_put(self, h: int, meta: BlockMeta, now: float) -> None:
        self.dram[h] = meta
        self.dram.move_to_end(h)
        while len(self.dram) > self.dram_blocks:
            victim, vmeta = self.dram.popitem(last=False)
            self.stats.dram_evictions += 1
            if vmeta.is_expired(now):
                self.stats.dram_expiries += 1
            elif not vmeta.is_durable:
                self.stats.dropped_dram_only += 1
            elif victim not in self.ssd:  # a clean copy (the SSD still holds it) needs no write
                self._ssd_put(victim, vmeta, now)

    def _ssd_put(self, h: int, meta: BlockMeta, now: float) -> None:
        """Write a block back (the caller checked it is durable and unexpired), evicting in (expiry, last_use)
        order to make room; a block the SSD holds already is not rewritten."""
        if self.ssd_blocks == 0 or h in self.ssd:
            return
        while len(self.ssd) >= self.ssd_blocks:
            self._evict_one(now)
        self.stats.writebacks += 1
        self._seq += 1
        self.ssd[h] = meta
        self._order[h] = self._seq
        self._push(h)

    def _push(self, h: int) -> None:
        meta = self.ssd[h]
        heapq.heappush(self._heap, (meta.expiry, meta.last_use, self._order[h], h))
        if len(self._heap) > 2 * len(self.ssd) + 64:  # bounded: rebuild from the held blocks
            self._heap = [(m.expiry, m.last_use, self._order[k], k) for k, m in self.ssd.items()]
            heapq.heapify(self._heap)

    def _evict_one(self, now: float) -> None:
        """Remove the SSD block first in ``(expiry, last_use, write order)``. Every held block has a heap entry
        whose key is at most its current one (keys only grow: ``BlockMeta.merge``), so an entry with an older
        key is re-pushed with the current key, and one of a block no longer held (or held anew) is skipped."""
        while True:
            expiry, last_use, order, h = heapq.heappop(self._heap)
            meta = self.ssd.get(h)
            if meta is None or self._order[h] != order:
                continue
            if meta.eviction_key() != (expiry, last_use):
                self._push(h)
                continue
            del self.ssd[h], self._order[h]
            if meta.is_expired(now):
                self.stats.ssd_expiries += 1
                if self.dram.pop(h, None) is not None:
                    self.stats.dram_expiries += 1
            else:
                self.stats.ssd_evictions += 1
            return

    def counters(self) -> dict[str, int]:
        """The non-zero counters plus the blocks held now."""
        out = {k: v for k, v in self.stats.as_dict().items() if v and isinstance(v, int)}
        out.update(dram_blocks=len(self.dram), ssd_blocks=len(self.ssd))
        return out
