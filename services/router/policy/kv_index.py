"""The router's KV index: which worker holds which KV blocks, in which tier, fed by ``di.v1.kv.*.events``.

Tiers are the closed set ``protocol.KV_TIERS``: ``"device"`` (a worker's GPU pool, what ``overlap`` reports), and
the slower ``"host"``, ``"disk"`` and ``"cache_tier"`` (what ``tier_overlap`` reports, i.e.
``ClusterView.remote_overlap``).

Invariants:
- An entry is one ``(hash, worker, tier)``. ``_lru`` (global recency order), ``_blocks[worker][tier]`` (the
  worker's hashes) and the bit of the worker's slot in ``_holders[tier][hash]`` always describe the same set
  of entries; a hash with no holder left is not a key of ``_holders[tier]``.
- At most ``max_blocks`` entries: a store beyond that evicts the least recently stored entries (a re-store of
  an entry refreshes it; lookups do not), and each eviction is counted. Eviction only ever hides cached
  blocks, so the index under-reports, never over-reports.
- Per worker, events are applied strictly in ``seq`` order, starting at 1 for a worker not yet known (or
  at ``snapshot seq + 1`` after ``resync``). ``seq <= last`` is a duplicate (ignored). ``seq > last + 1`` is a
  gap: the worker's entries are dropped (they may be stale) and it is flagged until ``resync``; every event
  of a flagged worker is ignored and ``apply`` returns False, so the caller (re)requests a snapshot.
- ``overlap``/``tier_overlap`` cost O(prompt blocks) dict lookups plus O(workers matched): worker sets are
  bitmasks of slots intersected while walking the prompt, stopping at the first block nobody holds.
- A hash is only a hint (``shared/kv/block_hash.py``): these are the blocks' 64-bit keys under each worker's model
  fingerprint, and the index compares nothing else, so a key collision can only mislead placement (a predicted
  hit the worker then computes); what is served is confirmed by the block's full digest and token ids.

Not thread-safe: the router calls it from its event loop only. A worker restarted under the same id restarts
at seq 1, which reads as duplicates: the caller compares ``last_seq`` with the worker's heartbeat
``kv_event_seq`` and calls ``remove_worker`` when the worker went backwards.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from shared.protocol import KVEvent

DEVICE = "device"
_HASH_BITS, _TIER_BITS = 64, 16
_HASH_MASK, _TIER_MASK = (1 << _HASH_BITS) - 1, (1 << _TIER_BITS) - 1
_SLOT_SHIFT = _HASH_BITS + _TIER_BITS
_MISSING = object()


@dataclass(slots=True)
class _Worker:
    slot: int
    last_seq: int = 0
    flagged: bool = False
    blocks: dict[str, set[int]] = field(default_factory=dict)  # tier -> hashes held

    @property
    def bit(self) -> int:
        return 1 << self.slot


def _check_hashes(hashes: Sequence[int]) -> None:
    if hashes and (min(hashes) < 0 or max(hashes) > _HASH_MASK):
        raise ValueError("block hashes must be unsigned 64-bit ints")


class KVIndex:
    def __init__(self, max_blocks: int = 2_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[str | None] = []        # slot -> worker id
        self._free_slots: list[int] = []
        self._tier_code: dict[str, int] = {}
        self._tier_name: list[str] = []
        self._holders: dict[str, dict[int, int]] = {}   # tier -> hash -> bitmask of worker slots
        self._lru: OrderedDict[int, None] = OrderedDict()  # key: slot << 80 | tier code << 64 | hash
        self._evictions = self._gaps = self._resyncs = 0

    # ---- event stream ----------------------------------------------------------------------------------
    def apply(self, event: KVEvent) -> bool:
        """Apply one event; False when the worker needs a snapshot (a gap now, or one not yet resynced)."""
        w = self._workers.get(event.worker_id) or self._add_worker(event.worker_id)
        if w.flagged:
            return False
        if event.seq <= w.last_seq:
            return True  # duplicate (redelivery)
        if event.seq > w.last_seq + 1:
            self._drop(w)
            w.flagged = True
            self._gaps += 1
            return False
        if event.kind != "cleared":
            _check_hashes(event.block_hashes)
        if event.kind == "stored":
            self._store(w, event.tier, event.block_hashes)
        elif event.kind == "removed":
            self._remove(w, event.tier, event.block_hashes)
        elif event.kind == "cleared":
            self._clear(w, event.tier)
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")
        w.last_seq = event.seq
        return True

    def resync(self, worker_id: str, seq: int, blocks: dict[str, list[int]]) -> None:
        """Replace the worker's entries with a snapshot taken at ``seq``; events resume at ``seq + 1``.
        Within a tier, later hashes count as more recently stored."""
        for hashes in blocks.values():
            _check_hashes(hashes)
        w = self._workers.get(worker_id) or self._add_worker(worker_id)
        self._drop(w)
        for tier, hashes in blocks.items():
            self._store(w, tier, hashes)
        w.last_seq, w.flagged = seq, False
        self._resyncs += 1

    def needs_resync(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.flagged

    def workers_needing_resync(self) -> list[str]:
        return sorted(wid for wid, w in self._workers.items() if w.flagged)

    def last_seq(self, worker_id: str) -> int | None:
        """Seq of the last event applied (or snapshot) for the worker; None when it is not known."""
        w = self._workers.get(worker_id)
        return None if w is None else w.last_seq

    def worker_ids(self) -> list[str]:
        """Every worker the index holds state for (entries, a sequence number or a resync flag)."""
        return list(self._workers)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead worker: its entries, its sequence number and its slot (no-op when unknown)."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._drop(w)
            self._slot_owner[w.slot] = None
            heapq.heappush(self._free_slots, w.slot)

    # ---- lookups ---------------------------------------------------------------------------------------
    def overlap(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """``{worker: leading prompt blocks it holds in "device"}`` for every worker holding at least one."""
        holders = self._holders.get(DEVICE)
        result: dict[str, int] = {}
        if not holders or not block_hashes:
            return result
        alive = holders.get(block_hashes[0], 0)
        depth = 1
        for h in islice(block_hashes, 1, None):
            if not alive:
                break
            still = alive & holders.get(h, 0)
            if still != alive:
                self._credit(result, alive ^ still, depth)
            alive, depth = still, depth + 1
        if alive:
            self._credit(result, alive, depth)
        return result

    def tier_overlap(self, block_hashes: Sequence[int], tier: str) -> int:
        """Leading prompt blocks each held by someone (any worker or store) in ``tier``."""
        holders = self._holders.get(tier)
        if not holders:
            return 0
        n = 0
        for h in block_hashes:
            if h not in holders:
                break
            n += 1
        return n

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._lru), "workers": len(self._workers), "evictions": self._evictions,
                "gaps": self._gaps, "resyncs": self._resyncs,
                "needs_resync": sum(w.flagged for w in self._workers.values())}

    # ---- internals -------------------------------------------------------------------------------------
    def _credit(self, result: dict[str, int], mask: int, depth: int) -> None:
        owner = self._slot_owner
        while mask:
            low = mask & -mask
            result[owner[low.bit_length() - 1]] = depth
            mask ^= low

    def _add_worker(self, worker_id: str) -> _Worker:
        if self._free_slots:  # reuse the lowest free slot: keeps bitmasks short
            slot = heapq.heappop(self._free_slots)
            self._slot_owner[slot] = worker_id
        else:
            slot = len(self._slot_owner)
            self._slot_owner.append(worker_id)
        w = self._workers[worker_id] = _Worker(slot)
        return w

    def _code(self, tier: str) -> int:
        code = self._tier_code.get(tier)
        if code is None:
            if len(self._tier_name) > _TIER_MASK:
                raise ValueError(f"too many distinct KV tiers (tier {tier!r})")
            code = self._tier_code[tier] = len(self._tier_name)
            self._tier_name.append(tier)
        return code

    def _store(self, w: _Worker, tier: str, hashes: Iterable[int]) -> None:
        hset = w.blocks.setdefault(tier, set())
        holders = self._holders.setdefault(tier, {})
        base, bit = (w.slot << _SLOT_SHIFT) | (self._code(tier) << _HASH_BITS), w.bit
        lru, cap = self._lru, self.max_blocks
        for h in hashes:
            key = base | h
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = None
            hset.add(h)
            holders[h] = holders.get(h, 0) | bit
            if len(lru) > cap:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        key, _ = self._lru.popitem(last=False)
        h, tier = key & _HASH_MASK, self._tier_name[(key >> _HASH_BITS) & _TIER_MASK]
        w = self._workers[self._slot_owner[key >> _SLOT_SHIFT]]
        w.blocks[tier].discard(h)
        self._unhold(tier, h, w.bit)
        self._evictions += 1

    def _remove(self, w: _Worker, tier: str, hashes: Iterable[int]) -> None:
        hset = w.blocks.get(tier)
        if not hset:
            return
        base, bit = (w.slot << _SLOT_SHIFT) | (self._code(tier) << _HASH_BITS), w.bit
        for h in hashes:
            if h in hset:
                hset.discard(h)
                del self._lru[base | h]
                self._unhold(tier, h, bit)

    def _clear(self, w: _Worker, tier: str) -> None:
        hset = w.blocks.pop(tier, None)
        if not hset:
            return
        base, bit, lru = (w.slot << _SLOT_SHIFT) | (self._code(tier) << _HASH_BITS), w.bit, self._lru
        for h in hset:
            del lru[base | h]
            self._unhold(tier, h, bit)

    def _drop(self, w: _Worker) -> None:
        for tier in list(w.blocks):
            self._clear(w, tier)

    def _unhold(self, tier: str, h: int, bit: int) -> None:
        holders = self._holders[tier]
        rest = holders[h] & ~bit
        if rest:
            holders[h] = rest
        else:
            del holders[h]
