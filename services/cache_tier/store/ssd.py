"""The SSD tier: blocks in append-only segment files, an in-memory index rebuilt from them at open.

Thread-safety and blocking: every public method except ``contains`` takes ``self._lock`` and does file I/O;
call them from a worker thread (``TieredBlockStore`` uses one dedicated thread), never on the event loop.
``contains`` is a lock-free dict lookup (a hint: may be stale by in-flight operations).

Invariants (besides those of ``SsdIndex`` and ``SegmentFiles``):
- Only durable, unexpired blocks are written (``BlockMeta.is_durable``): class-``none`` blocks never reach SSD.
- ``put_many`` returns (acknowledges) only after every record is fully written and, unless
  ``fsync == "never"``, fsynced; a SIGKILL before that loses at most the unacknowledged blocks.
- Every read checks both crcs and the hash; a record that fails is dropped from the index, counted in
  ``ssd_checksum_failures`` and reads as a miss: a torn or corrupt block is never served.
- Segment files total at most ``ssd_bytes`` at every instant (dead bytes included): writes make room
  within ``ssd_write_budget`` by dropping expired blocks, compacting mostly-dead segments, then evicting in
  ``(expiry, last_use)`` order down to the low watermark and compacting; compaction copies at most one
  segment's live bytes into the ``segment_bytes`` headroom before deleting the old file.
- Eviction and expiry are not logged to disk: after a restart an evicted block whose segment was not yet
  compacted comes back (harmless: it is intact and still unexpired); expired blocks are dropped at open.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from shared.errors import DeepinferError, ErrorCode
from services.cache_tier.store.block import StoredBlock
from services.cache_tier.store.clock import Clock
from services.cache_tier.store.config import StoreConfig
from services.cache_tier.store.index import SsdIndex
from services.cache_tier.store.rebuild import rebuild_index
from services.cache_tier.store.record import KIND_BLOCK, decode_block, encode_block, encode_touch, rewrite_meta, verify
from shared.retention import BlockMeta
from services.cache_tier.store.segments import SegmentFiles
from services.cache_tier.store.stats import StoreStats

logger = logging.getLogger(__name__)

MAX_PENDING_TOUCHES = 4096       # extensions waiting to be written before a flush is forced


class SsdTier:
    """Opening rebuilds the index (``O(records)`` header reads; bodies verified only in the newest segment,
    the only one a process crash can tear) and truncates torn tails. Raises ``unavailable`` if another process holds
    the directory."""

    def __init__(self, config: StoreConfig, clock: Clock, stats: StoreStats) -> None:
        self.config = config
        self._clock = clock
        self._stats = stats
        self._lock = threading.Lock()
        self._index = SsdIndex()
        self._pending: set[int] = set()   # hashes whose extension should be written as a touch record
        directory = Path(config.directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DeepinferError(ErrorCode.UNAVAILABLE, f"block store {directory} is open in another process")
        self._files = SegmentFiles(directory, config.segment_bytes, config.fsync)
        self._closed = False
        try:
            with self._lock:
                self._rebuild()
                self._files.start_active()
                self._make_room(0, clock.now())
        except BaseException:
            self.close()
            raise

    # -- queries ------------------------------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self._index.locs

    @property
    def live_bytes(self) -> int:
        return self._index.live_bytes

    @property
    def disk_bytes(self) -> int:
        return self._files.disk_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_segments(self) -> int:
        return len(self._files.segments)

    def hashes(self) -> list[int]:
        """Every block hash the index holds now."""
        with self._lock:
            return list(self._index.locs)

    def location(self, block_hash: int) -> tuple[Path, int, int] | None:
        """(segment path, offset, length) of a block's record (tests, diagnostics)."""
        with self._lock:
            loc = self._index.get(block_hash)
            return None if loc is None else (self._files.segments[loc.segment_id].path, loc.offset, loc.length)

    def eviction_order(self) -> list[int]:
        """Every held hash, next victim first (tests, diagnostics)."""
        with self._lock:
            return self._index.eviction_order()

    # -- blocks -------------------------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[StoredBlock, BlockMeta]]) -> list[int]:
        """Write blocks; returns the hashes written, once durable (DRAM-only or expired ones are skipped).

        A block already held keeps the later of the two expiries. Raises ``OSError`` on I/O failure: then
        nothing of the batch counts as acknowledged (records written before the failure stay readable).
        """
        with self._lock:
            self._check_open()
            now = self._clock.now()
            acked = []
            for block, meta in items:
                if not meta.is_durable or meta.is_expired(now):
                    continue
                meta = meta.copy()
                if (old := self._index.get(block.block_hash)) is not None:
                    meta.merge(old.meta)
                record = encode_block(block, meta)
                self._make_room(len(record), now)
                segment_id, offset = self._files.append(record)
                self._index.set_block(block.block_hash, segment_id, offset, len(record), meta)
                self._pending.discard(block.block_hash)
                self._stats.ssd_blocks_written += 1
                self._stats.ssd_bytes_written += len(record)
                acked.append(block.block_hash)
            self._write_touches(now)
            self._files.sync()
            return acked

    def get(self, block_hash: int, token_ids: Sequence[int], retention: str, digest: bytes = b"",
            fingerprint: str = "") -> tuple[StoredBlock, BlockMeta] | None:
        """The block and its retention state after this use, or None: absent, expired, failed its checksums
        (dropped), or another block (tokens, digest or build differ). A hit extends the expiry by ``retention``."""
        with self._lock:
            self._check_open()
            loc = self._index.get(block_hash)
            if loc is None:
                return None
            now = self._clock.now()
            if loc.meta.is_expired(now):
                self._index.remove(block_hash)
                self._stats.ssd_expiries += 1
                return None
            try:
                record = self._files.read(loc.segment_id, loc.offset, loc.length)
            except OSError as exc:
                logger.warning("block %016x: read failed: %s", block_hash, exc)
                record = b""
            decoded = decode_block(record, block_hash, self.config.segment_bytes)
            if decoded is None:
                logger.warning("block %016x: record in segment %d at %d failed its checksum: dropped",
                               block_hash, loc.segment_id, loc.offset)
                self._index.remove(block_hash)
                self._stats.ssd_checksum_failures += 1
                return None
            self._stats.ssd_bytes_read += len(record)
            block = decoded[0]
            if (miss := block.mismatch(token_ids, digest, fingerprint)) is not None:
                self._stats.ssd_token_mismatches += miss == "tokens"
                self._stats.ssd_identity_mismatches += miss == "identity"
                return None
            self._touch(block_hash, self.config.retention.new_meta(retention, now))
            return block, loc.meta.copy()

    def touch_many(self, items: Iterable[tuple[int, BlockMeta]]) -> None:
        """Fold later uses into held blocks (unknown hashes are ignored); an extension of at least
        ``touch_persist_s`` over the on-disk expiry is queued for a touch record (written with the next batch,
        ``flush`` or once ``MAX_PENDING_TOUCHES`` are queued)."""
        with self._lock:
            self._check_open()
            for block_hash, meta in items:
                self._touch(block_hash, meta)
            if len(self._pending) >= MAX_PENDING_TOUCHES:
                self._write_touches(self._clock.now())
                self._files.sync()

    def gc(self) -> tuple[int, int]:
        """Drop expired blocks and compact segments at least ``compact_dead_ratio`` dead:
        (blocks expired, segments compacted)."""
        with self._lock:
            self._check_open()
            now = self._clock.now()
            expired = self._expire(now)
            compacted = 0
            for segment_id in self._dead_order(self.config.compact_dead_ratio):
                self._compact(segment_id)
                compacted += 1
            self._write_touches(now)
            self._files.sync()
            return expired, compacted

    def flush(self) -> None:
        """Write queued extensions and make everything durable."""
        with self._lock:
            self._check_open()
            self._write_touches(self._clock.now())
            self._files.sync()

    def close(self) -> None:
        """Flush, close every file and release the directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._files.active is not None:
                    self._write_touches(self._clock.now())
            finally:
                self._files.close()
                os.close(self._lock_fd)

    # -- internals (lock held) ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise DeepinferError(ErrorCode.UNAVAILABLE, "block store is closed")

    def _touch(self, block_hash: int, meta: BlockMeta) -> None:
        loc = self._index.get(block_hash)
        if loc is None:
            return
        self._index.update_meta(block_hash, meta)
        if loc.meta.expiry - loc.durable_expiry >= max(self.config.touch_persist_s, 1e-9):
            self._pending.add(block_hash)

    def _expire(self, now: float) -> int:
        expired = len(self._index.pop_expired(now))
        self._stats.ssd_expiries += expired
        return expired

    def _write_touches(self, now: float) -> None:
        for block_hash in sorted(self._pending):
            loc = self._index.get(block_hash)
            if loc is None or loc.meta.expiry <= loc.durable_expiry or loc.meta.is_expired(now):
                continue
            record = encode_touch(block_hash, loc.meta)
            self._make_room(len(record), now)
            if (loc := self._index.get(block_hash)) is None:   # evicted while making room
                continue
            segment_id, offset = self._files.append(record)
            self._index.set_touch(block_hash, segment_id, offset, loc.meta.copy())
            self._stats.ssd_touches_written += 1
            self._stats.ssd_bytes_written += len(record)
        self._pending.clear()

    def _dead_order(self, min_ratio: float) -> list[int]:
        """Segments with at least ``min_ratio`` of their bytes dead, most dead bytes first."""
        live = self._index.segment_live
        dead = [(seg.size - live.get(i, 0), i) for i, seg in self._files.segments.items()
                if seg.size and seg.size - live.get(i, 0) >= min_ratio * seg.size]
        return [i for d, i in sorted(dead, reverse=True) if d > 0]

    def _make_room(self, need: int, now: float) -> None:
        """Ensure ``disk_bytes + need <= ssd_write_budget`` (see the module docstring for the order)."""
        budget = self.config.ssd_write_budget
        if self._files.disk_bytes + need <= budget:
            return
        self._expire(now)
        for segment_id in self._dead_order(self.config.compact_dead_ratio):
            if self._files.disk_bytes + need <= budget:
                return
            self._compact(segment_id)
        low = int(budget * self.config.evict_low_watermark)
        while self._files.disk_bytes + need > budget:
            while self._index.live_bytes + need > low and self._index.pop_victim() is not None:
                self._stats.ssd_evictions += 1
            candidates = self._dead_order(1e-9)
            if not candidates:
                break
            self._compact(candidates[0])

    def _compact(self, segment_id: int) -> None:
        """Copy a segment's live records (headers rewritten with the current retention state) to the active
        segment, make them durable, then delete the old file."""
        if self._files.active is not None and segment_id == self._files.active.segment_id:
            self._files.start_active()
        copied = 0
        for block_hash in sorted(self._index.members.get(segment_id, ())):
            loc = self._index.get(block_hash)
            if loc.segment_id == segment_id:
                record = self._files.read(segment_id, loc.offset, loc.length)
                header = verify(record, block_hash, self.config.segment_bytes)
                if header is None or header.kind != KIND_BLOCK:
                    logger.warning("block %016x: corrupt record in segment %d dropped by compaction",
                                   block_hash, segment_id)
                    self._index.remove(block_hash)
                    self._stats.ssd_checksum_failures += 1
                    continue
                record = rewrite_meta(record, header, loc.meta)
                new_segment, offset = self._files.append(record)
                self._index.set_block(block_hash, new_segment, offset, len(record), loc.meta)
            else:   # only its touch record lives here
                record = encode_touch(block_hash, loc.meta)
                new_segment, offset = self._files.append(record)
                self._index.set_touch(block_hash, new_segment, offset, loc.meta.copy())
            self._pending.discard(block_hash)
            copied += len(record)
            self._stats.ssd_bytes_written += len(record)
        self._files.sync()
        size = self._files.delete(segment_id)
        self._index.drop_segment(segment_id)
        self._stats.ssd_compactions += 1
        self._stats.ssd_bytes_reclaimed += size - copied
        logger.debug("compacted segment %d: %d bytes, %d live copied", segment_id, size, copied)

    def _rebuild(self) -> None:
        self._pending |= rebuild_index(self._files, self._index, self.config, self._stats)
        self._expire(self._clock.now())
