"""Counters of the block store, the quantities the cache-tier service will expose on its stats subject.

One ``StoreStats`` per store. Ownership (each field has one writer, so no lock is needed under the GIL):
``dram_*`` and ``store_*`` fields are written on the event loop; ``ssd_*`` fields only by the SSD tier while
it holds its lock (its single I/O thread). Gauges (bytes stored, block counts) are filled in by
``TieredBlockStore.stats()`` at snapshot time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StoreStats:
    # DRAM tier
    dram_hits: int = 0
    dram_misses: int = 0
    dram_evictions: int = 0          # LRU evictions (written back, dropped as DRAM-only, or already on SSD)
    dram_expiries: int = 0
    dram_bytes: int = 0              # gauge
    dram_blocks: int = 0             # gauge
    # SSD tier
    ssd_hits: int = 0
    ssd_misses: int = 0
    ssd_evictions: int = 0           # capacity evictions in (expiry, last_use) order
    ssd_expiries: int = 0
    ssd_checksum_failures: int = 0   # records never served: bad checksum, torn or unreadable
    ssd_bytes_read: int = 0
    ssd_bytes_written: int = 0       # every record byte appended (blocks, touches, compaction copies)
    ssd_blocks_written: int = 0
    ssd_touches_written: int = 0
    ssd_compactions: int = 0         # segments compacted
    ssd_bytes_reclaimed: int = 0     # segment bytes freed by compaction
    ssd_truncated_bytes: int = 0     # torn tails cut off at open
    ssd_rebuild_records: int = 0
    ssd_rebuild_s: float = 0.0
    ssd_live_bytes: int = 0          # gauge: bytes of records the index points to
    ssd_disk_bytes: int = 0          # gauge: total segment file bytes (live + dead)
    ssd_blocks: int = 0              # gauge
    ssd_segments: int = 0            # gauge
    # whole store
    store_token_mismatches: int = 0  # hash matched, tokens did not: a miss
    store_promotions: int = 0        # SSD -> DRAM on a hit
    store_writebacks: int = 0        # DRAM -> SSD blocks written on eviction or flush
    store_writeback_failures: int = 0
    store_dropped_dram_only: int = 0  # class-none blocks evicted from DRAM (never written to SSD)

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)
