"""The SSD tier's in-memory index: where each block's record lives, its retention state, and eviction order.

Pure bookkeeping (no I/O), owned by ``SsdTier`` and used under its lock.

Invariants:
- ``locs[h]`` points at the one *live* block record of ``h`` (segment, offset, length) and, optionally, at
  one live touch record (``touch``: a later record holding a longer expiry than the block record's header).
  Every other record of ``h`` on disk is dead.
- ``live_bytes == sum(segment_live.values())`` == the lengths of all live block records plus
  ``TOUCH_BYTES`` per live touch; ``members[s]`` is exactly the set of hashes with a live record in segment s.
- ``durable_expiry`` is the expiry the live records of ``h`` carry on disk (what a rebuild would find);
  ``meta.expiry >= durable_expiry``: the difference is extension not yet persisted.
- Every loc has one heap entry ``(expiry, last_use, seq, h)`` with its current ``seq``; older entries are
  stale and skipped. The heap is rebuilt once it holds more than ``2 * len + 64`` entries (bounded memory).
  Popping it yields blocks in eviction order: soonest expiry, then least recent use.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from services.cache_tier.store.record import TOUCH_BYTES
from shared.retention import BlockMeta


@dataclass(slots=True)
class Loc:
    segment_id: int
    offset: int
    length: int
    meta: BlockMeta
    durable_expiry: float
    touch: tuple[int, int] | None = None   # (segment_id, offset) of the live touch record
    seq: int = 0

    def segments(self) -> set[int]:
        return {self.segment_id} if self.touch is None else {self.segment_id, self.touch[0]}


class SsdIndex:
    def __init__(self) -> None:
        self.locs: dict[int, Loc] = {}
        self.segment_live: dict[int, int] = {}
        self.members: dict[int, set[int]] = {}
        self.live_bytes = 0
        self._heap: list[tuple[float, float, int, int]] = []
        self._seq = 0
        self._bulk = False    # while loading: heap entries are built once at the end

    def __len__(self) -> int:
        return len(self.locs)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.locs

    def get(self, block_hash: int) -> Loc | None:
        return self.locs.get(block_hash)

    def _bytes(self, loc: Loc, sign: int) -> None:
        self.segment_live[loc.segment_id] = self.segment_live.get(loc.segment_id, 0) + sign * loc.length
        self.live_bytes += sign * loc.length
        if loc.touch is not None:
            self.segment_live[loc.touch[0]] = self.segment_live.get(loc.touch[0], 0) + sign * TOUCH_BYTES
            self.live_bytes += sign * TOUCH_BYTES

    def _relink(self, h: int, before: set[int], loc: Loc | None) -> None:
        after = loc.segments() if loc is not None else set()
        for s in before - after:
            self.members[s].discard(h)
        for s in after - before:
            self.members.setdefault(s, set()).add(h)

    def _push(self, h: int, loc: Loc) -> None:
        self._seq += 1
        loc.seq = self._seq
        if self._bulk:
            return
        heapq.heappush(self._heap, (loc.meta.expiry, loc.meta.last_use, loc.seq, h))
        if len(self._heap) > 2 * len(self.locs) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(v.meta.expiry, v.meta.last_use, v.seq, k) for k, v in self.locs.items()]
        heapq.heapify(self._heap)

    def bulk_load(self, loading: bool) -> None:
        """``True`` before replaying a whole log (no per-change heap pushes), ``False`` after (one heapify)."""
        self._bulk = loading
        if not loading:
            self._rebuild_heap()

    def set_block(self, h: int, segment_id: int, offset: int, length: int, meta: BlockMeta,
                  durable_expiry: float | None = None) -> Loc:
        """``h``'s live block record is now here (any older record and touch of ``h`` become dead)."""
        old = self.locs.get(h)
        before = set()
        if old is not None:
            self._bytes(old, -1)
            before = old.segments()
        loc = Loc(segment_id, offset, length, meta.copy(),
                  meta.expiry if durable_expiry is None else durable_expiry)
        self.locs[h] = loc
        self._bytes(loc, +1)
        self._relink(h, before, loc)
        self._push(h, loc)
        return loc

    def set_touch(self, h: int, segment_id: int, offset: int, meta: BlockMeta) -> None:
        """A touch record carrying ``meta`` now holds ``h``'s durable expiry (the previous touch is dead)."""
        loc = self.locs[h]
        before = loc.segments()
        self._bytes(loc, -1)
        loc.touch = (segment_id, offset)
        loc.durable_expiry = meta.expiry
        self._bytes(loc, +1)
        self._relink(h, before, loc)
        self.update_meta(h, meta)

    def update_meta(self, h: int, meta: BlockMeta) -> None:
        """Fold a later use/extension into ``h``'s in-memory state (expiry and last use only grow)."""
        loc = self.locs[h]
        key = loc.meta.eviction_key()
        loc.meta.merge(meta)
        if loc.meta.eviction_key() != key:
            self._push(h, loc)

    def remove(self, h: int) -> Loc | None:
        """Forget ``h``: all its records become dead."""
        loc = self.locs.pop(h, None)
        if loc is not None:
            self._bytes(loc, -1)
            self._relink(h, loc.segments(), None)
        return loc

    def _top(self) -> tuple[float, float, int, int] | None:
        while self._heap:
            expiry, last_use, seq, h = self._heap[0]
            loc = self.locs.get(h)
            if loc is not None and loc.seq == seq:
                return self._heap[0]
            heapq.heappop(self._heap)  # stale
        return None

    def pop_expired(self, now: float) -> list[int]:
        """Remove and return every block with ``expiry <= now``."""
        out = []
        while (top := self._top()) is not None and top[0] <= now:
            out.append(top[3])
            self.remove(top[3])
        return out

    def pop_victim(self) -> int | None:
        """Remove and return the next block in eviction order (None if empty)."""
        top = self._top()
        if top is None:
            return None
        self.remove(top[3])
        return top[3]

    def eviction_order(self) -> list[int]:
        """All hashes in eviction order (tests, diagnostics): O(n log n)."""
        return [h for h, loc in sorted(self.locs.items(), key=lambda kv: (*kv[1].meta.eviction_key(), kv[1].seq))]

    def drop_segment(self, segment_id: int) -> None:
        """Forget a segment that holds no live record any more."""
        if self.members.pop(segment_id, set()):
            raise AssertionError(f"segment {segment_id} still has live records")
        self.segment_live.pop(segment_id, None)
