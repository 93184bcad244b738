"""The block store of the cache tier: KV blocks kept in DRAM and on SSD for days, with retention classes.

Content-addressed by the chained block hash of ``shared/kv/block_hash.py`` (its 64-bit key; the model build's
fingerprint and the tenant salt are inside it, so builds and tenants never share a block); a hit is confirmed
by comparing the block's full 256-bit digest, its model fingerprint and its token ids, so neither a key collision
nor a directory kept across a model swap ever serves another prefix's or another build's KV. Layers:

- ``block``: ``StoredBlock``, the value (hash, token ids, dtype, shape, payload bytes, digest, fingerprint),
  validated.
- ``retention``: classes -> ttl (``chat`` 7 d, ``agent`` 3 d, ``none`` = DRAM-only), ``BlockMeta``.
- ``clock``: the one injectable time source (``FakeClock`` for tests).
- ``dram``: LRU bounded by bytes. ``ssd``: append-only segment files + index (``record`` format,
  ``segments`` files, ``index`` bookkeeping, ``rebuild`` at open). ``tiered``: the asyncio API over both.
- ``config``: ``StoreConfig``; ``stats``: ``StoreStats`` counters.

Why an append-only log and not an embedded KV store: our pinned dependencies hold none (adding LMDB,
RocksDB or SQLite bindings would be a new native dependency for one component), and the workload suits a
log: blocks are immutable, written once and read whole, 100 KB-10 MB each; a log turns every write into a
sequential append (the SSD's best case, no write amplification of a B-tree or LSM compaction beyond our own
segment compaction, which we schedule); the index is rebuilt by reading one fixed 60-byte header per record
and seeking over the body; and crash semantics are simple to state and test: a record is acknowledged only
once fully written (and fsynced by policy), a torn tail is cut off at the first bad header, and a checksum
on every record keeps a torn or corrupt block from ever being served.
"""
from services.cache_tier.store.block import DTYPE_SIZES, StoredBlock
from services.cache_tier.store.clock import Clock, FakeClock, SystemClock
from services.cache_tier.store.config import StoreConfig
from shared.retention import DEFAULT_TTL_S, BlockMeta, RetentionPolicy
from services.cache_tier.store.stats import StoreStats
from services.cache_tier.store.tiered import GcReport, TieredBlockStore

__all__ = [
    "DEFAULT_TTL_S", "DTYPE_SIZES", "BlockMeta", "Clock", "FakeClock", "GcReport", "RetentionPolicy",
    "StoreConfig", "StoreStats", "StoredBlock", "SystemClock", "TieredBlockStore",
]
