"""Counters of the block store: the quantities the cache-tier service will expose on its stats subject.

One ``StoreStats`` per store. Every field has exactly one writer, so plain ``+=`` stays exact under the GIL:
- *loop*: written by ``TieredBlockStore`` on the event loop;
- *ssd*: written by ``SsdTier`` under its lock (its one I/O thread);
- *gauge*: filled in by ``TieredBlockStore.stats()`` at snapshot time.
A lookup counts one of ``dram_hits``, ``ssd_hits`` or ``misses``; a lookup that got past DRAM also counts
``dram_misses``, and one that got past SSD ``ssd_misses``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StoreStats:
    # loop
    dram_hits: int = 0
    dram_misses: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    misses: int = 0
    dram_evictions: int = 0           # LRU pushes (incl. blocks too big for DRAM), whatever became of them
    dram_expiries: int = 0
    dram_token_mismatches: int = 0    # hash matched, tokens did not: a miss
    dram_identity_mismatches: int = 0  # hash and tokens matched, digest or model build did not: a miss
    promotions: int = 0               # SSD -> DRAM on a hit
    writebacks: int = 0               # DRAM -> SSD blocks acknowledged (eviction or flush)
    writeback_failures: int = 0       # blocks lost to an SSD write error (logged)
    dropped_dram_only: int = 0        # class-none blocks evicted from DRAM (never written to SSD)
    write_behind_blocks: int = 0      # dirty DRAM blocks written to SSD by write-behind (also in writebacks)
    put_conflicts: int = 0            # puts of a held block with other bytes (first kept: nondeterminism, forgery)
    # ssd
    ssd_evictions: int = 0            # capacity evictions in (expiry, last_use) order
    ssd_expiries: int = 0
    ssd_token_mismatches: int = 0
    ssd_identity_mismatches: int = 0
    ssd_checksum_failures: int = 0    # records never served: bad checksum, torn or unreadable
    ssd_bytes_read: int = 0
    ssd_bytes_written: int = 0        # every record byte appended (blocks, touches, compaction copies)
    ssd_blocks_written: int = 0
    ssd_touches_written: int = 0
    ssd_compactions: int = 0          # segments compacted
    ssd_bytes_reclaimed: int = 0      # segment bytes freed by compaction, net of the copies
    ssd_truncated_bytes: int = 0      # torn tails cut off at open
    ssd_rebuild_records: int = 0
    ssd_rebuild_s: float = 0.0
    # gauge
    dram_bytes: int = 0
    dram_blocks: int = 0
    ssd_live_bytes: int = 0           # bytes of the records the index points to
    ssd_disk_bytes: int = 0           # total segment file bytes (live + dead)
    ssd_blocks: int = 0
    ssd_segments: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GcReport:
    """What one ``TieredBlockStore.gc`` removed."""

    dram_expired: int
    ssd_expired: int
    segments_compacted: int
