"""The DRAM tier: blocks in process memory, bounded by bytes, least recently used evicted first.

Not thread-safe: ``TieredBlockStore`` calls it from the event loop only (no I/O, never blocks).

Invariants:
- ``bytes_used == sum(entry.block.nbytes) <= capacity_bytes`` after every call.
- Iteration order of ``_entries`` is recency order, least recently used first; ``get`` and ``put`` make an
  entry the most recent, ``peek`` does not.
- ``put`` returns what it pushed out (LRU first), so the caller decides their fate (write-back or drop);
  a block larger than the whole tier is returned at once, never stored.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.cache_tier.store.block import StoredBlock
from shared.retention import BlockMeta


@dataclass(slots=True)
class DramEntry:
    block: StoredBlock
    meta: BlockMeta
    on_ssd: bool = False    # an identical record was on SSD when last checked: eviction need not rewrite it


class DramTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self._entries: OrderedDict[int, DramEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: int) -> DramEntry | None:
        """The entry, made most recently used."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
        return entry

    def peek(self, block_hash: int) -> DramEntry | None:
        return self._entries.get(block_hash)

    def put(self, entry: DramEntry) -> list[DramEntry]:
        """Insert (or replace) as most recent; returns the entries evicted to make room, LRU first."""
        nbytes = entry.block.nbytes
        if nbytes > self.capacity_bytes:
            return [entry]
        self.pop(entry.block.block_hash)
        evicted = []
        while self.bytes_used + nbytes > self.capacity_bytes:
            _, victim = self._entries.popitem(last=False)
            self.bytes_used -= victim.block.nbytes
            evicted.append(victim)
        self._entries[entry.block.block_hash] = entry
        self.bytes_used += nbytes
        return evicted

    def pop(self, block_hash: int) -> DramEntry | None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.bytes_used -= entry.block.nbytes
        return entry

    def pop_expired(self, now: float) -> list[DramEntry]:
        """Remove and return every expired entry (O(entries))."""
        expired = [h for h, e in self._entries.items() if e.meta.is_expired(now)]
        return [self.pop(h) for h in expired]

    def entries(self) -> list[DramEntry]:
        """A snapshot, least recently used first."""
        return list(self._entries.values())

    def lru_order(self) -> list[int]:
        return list(self._entries)
