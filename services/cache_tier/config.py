"""The cache tier's config (``python -m services.cache_tier``)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from shared.config import ServiceConfig
from shared.retention import DEFAULT_SPEC


@dataclass(frozen=True, slots=True)
class CacheTierConfig(ServiceConfig):
    """The cache tier service (``services/cache_tier``): one block store (DRAM + SSD directory) per instance."""

    ID_PREFIX = "cache"
    directory: str = ""  # SSD tier directory ("" = ~/.cache/deepinfer/cache-tier/<worker_id>)
    dram_mb: int = 1024
    # fault in the DRAM budget at start (services/cache_tier/store/dram_reserve.py): filling DRAM then never page-faults
    reserve_dram: bool = False
    ssd_mb: int = 65536
    segment_mb: int = 64
    fsync: str = "batch"  # always | batch | never (see services/cache_tier/store/config.py)
    # dirty chat/agent DRAM blocks are written behind to SSD within this: a block acknowledged more than
    # write_behind_s ago survives a SIGKILL (fsync adds no delay; it decides power-loss safety) while the SSD keeps up
    write_behind_s: float = 1.0
    retention: str = DEFAULT_SPEC  # class=ttl list; the deployment's retention classes (the router reads the same)
    transports: str = "shm,nixl,tcp,stream"  # offered (when available here), in preference order
    heartbeat_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    gc_interval_s: float = 60.0  # GC (expiry + compaction) and KV-event removals this often
    stage_ttl_s: float = 30.0  # a get's staging is released after this even without a CacheRelease
    fetch_timeout_s: float = 10.0  # a put's KV fetch from the worker
    max_staged_mb: int = 1024  # bytes staged for gets at once; a get that does not fit is answered 0 blocks
    price_cached: float = 0.02  # per million cached prompt tokens (accounting)
    price_uncached: float = 1.0  # per million uncached prompt tokens
    drain_grace_s: float = 5.0

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)  # slots=True rebuilds the class: no zero-argument super()
        if not self.directory:
            path = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", "cache-tier", self.worker_id)
            object.__setattr__(self, "directory", path)
        if (self.dram_mb < 0 or self.ssd_mb <= 0 or self.segment_mb <= 0 or self.heartbeat_s <= 0
                or self.gc_interval_s <= 0 or self.stage_ttl_s <= 0 or self.fetch_timeout_s <= 0
                or self.max_staged_mb <= 0 or self.drain_grace_s < 0 or not 0 < self.write_behind_s < 3600):
            raise ValueError("invalid cache tier config")
