"""``StoreConfig``: the block store's one frozen, validated configuration (the cache-tier service builds it)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.errors import invalid
from shared.retention import RetentionPolicy

FSYNC_POLICIES = ("always", "batch", "never")
RECORD_OVERHEAD_MAX = 16 << 10   # header + class name + metadata of one record, upper bound (MAX_BLOCK_TOKENS)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Limits and policies of one block store.

    - ``dram_bytes``: DRAM tier bound (payload + token bytes of the blocks it holds); 0 = every put goes
      straight to SSD (write-through).
    - ``ssd_bytes``: bound on the total size of the segment files, *dead space included* until compaction
      reclaims it. Ordinary writes keep the files at most ``ssd_bytes - segment_bytes``; the last
      ``segment_bytes`` are headroom for compaction, which copies live records before deleting a segment,
      so the bound holds at every instant.
    - ``segment_bytes``: size at which the active segment file is sealed and a new one started.
    - ``max_block_bytes``: largest payload accepted (``payload_too_large`` above it).
    - ``fsync``: ``always`` (fsync after every record), ``batch`` (default: one fsync per ``put_many`` batch,
      before it is acknowledged), ``never`` (leave it to the OS: survives a process crash, not a power loss).
      Sealed segments and compaction output are fsynced unless ``never``.
    - ``compact_dead_ratio``: GC compacts a segment once this fraction of its bytes is dead.
    - ``evict_low_watermark``: capacity eviction frees live bytes down to this fraction of the write budget,
      so eviction runs in batches rather than on every write.
    - ``touch_persist_s``: an expiry extension is written to SSD (a small touch record) once it moves the
      on-disk expiry by at least this much; after a restart an expiry is at most this much too early.
    - ``write_behind_s``: dirty durable DRAM blocks are written behind to SSD within this many seconds
      (``write_behind.py``): a block acknowledged more than ``write_behind_s`` ago survives a SIGKILL (every
      fsync policy; a power loss too unless ``never``), as long as the SSD keeps up (a batch write within
      ``write_behind_s / 4``). None = off: DRAM blocks reach SSD only under LRU pressure, ``flush`` or close.
    """

    directory: str
    dram_bytes: int = 1 << 30
    ssd_bytes: int = 64 << 30
    segment_bytes: int = 64 << 20
    max_block_bytes: int = 16 << 20
    fsync: str = "batch"
    compact_dead_ratio: float = 0.5
    evict_low_watermark: float = 0.9
    touch_persist_s: float = 3600.0
    write_behind_s: float | None = None
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise invalid("block store directory must be a non-empty path")
        for name in ("dram_bytes", "ssd_bytes", "segment_bytes", "max_block_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise invalid(f"{name} must be an int ≥ 0, got {value!r}")
        if self.max_block_bytes < 1 or self.max_block_bytes + RECORD_OVERHEAD_MAX > self.segment_bytes:
            raise invalid(f"max_block_bytes + {RECORD_OVERHEAD_MAX} must fit in segment_bytes "
                          f"({self.max_block_bytes} vs {self.segment_bytes})")
        if self.ssd_bytes < 2 * self.segment_bytes:
            raise invalid(f"ssd_bytes ({self.ssd_bytes}) must be ≥ 2 * segment_bytes ({self.segment_bytes})")
        if self.fsync not in FSYNC_POLICIES:
            raise invalid(f"fsync must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        for name in ("compact_dead_ratio", "evict_low_watermark"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise invalid(f"{name} must be in (0, 1], got {value!r}")
        if not isinstance(self.touch_persist_s, (int, float)) or not math.isfinite(self.touch_persist_s) \
                or self.touch_persist_s < 0:
            raise invalid(f"touch_persist_s must be finite seconds ≥ 0, got {self.touch_persist_s!r}")
        wb = self.write_behind_s
        if wb is not None and (isinstance(wb, bool) or not isinstance(wb, (int, float)) or not math.isfinite(wb)
                               or wb <= 0):
            raise invalid(f"write_behind_s must be finite seconds > 0 or None, got {self.write_behind_s!r}")
        if not isinstance(self.retention, RetentionPolicy):
            raise invalid("retention must be a RetentionPolicy")

    @property
    def ssd_write_budget(self) -> int:
        """Bytes ordinary writes may fill; the rest is compaction headroom."""
        return self.ssd_bytes - self.segment_bytes
