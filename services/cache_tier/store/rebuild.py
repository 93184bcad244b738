"""Rebuild the SSD tier's index from its segment files at open (the only recovery procedure there is).

Segments are read oldest first, records in file order, so the log order is replayed:
- A block record makes itself the block's live record (earlier ones become dead); expiry and last use merge
  by max with anything seen before, so replays of crash leftovers (a compaction copy next to its original)
  are harmless.
- A touch record becomes the block's live touch if it carries a longer expiry than the records before it;
  a touch of an unknown block is dead (its block record was superseded or dropped).
- Only the newest segment can hold a torn tail (older ones were sealed and fsynced), so only its bodies are
  crc-checked here; in every segment the scan stops at the first torn or invalid header and the file is
  truncated there. Bodies elsewhere are checked on every read.
Cost: one 60-byte header read per record (buffered; bodies seeked over) plus one pass over the newest segment.
"""
from __future__ import annotations

import logging
import os
import time

from services.cache_tier.store.config import StoreConfig
from services.cache_tier.store.index import SsdIndex
from services.cache_tier.store.record import KIND_BLOCK, RecordHeader, scan_segment
from services.cache_tier.store.segments import SegmentFiles
from services.cache_tier.store.stats import StoreStats

logger = logging.getLogger(__name__)

_SCAN_BUFFER = 1 << 20


def rebuild_index(files: SegmentFiles, index: SsdIndex, config: StoreConfig, stats: StoreStats) -> set[int]:
    """Fill ``index`` and ``files`` from the directory; returns the hashes whose merged expiry is ahead of
    what their live records carry by at least ``touch_persist_s`` (to be re-persisted as touches)."""
    started = time.perf_counter()
    existing = files.existing()
    newest = existing[-1][0] if existing else None
    num_records = 0
    index.bulk_load(True)
    for segment_id, path in existing:
        size = path.stat().st_size
        with open(path, "rb", buffering=_SCAN_BUFFER) as f:
            scan = scan_segment(f, size, segment_id == newest, config.segment_bytes)
        stats.ssd_checksum_failures += scan.bad_bodies
        if scan.valid_end < size:
            logger.warning("segment %s: torn tail of %d bytes at offset %d truncated", path.name,
                           size - scan.valid_end, scan.valid_end)
            os.truncate(path, scan.valid_end)
            stats.ssd_truncated_bytes += size - scan.valid_end
        if scan.valid_end == 0:
            path.unlink()
            continue
        files.adopt(segment_id, path, scan.valid_end)
        for offset, header in scan.records:
            _replay(index, segment_id, offset, header)
        num_records += len(scan.records)
    index.bulk_load(False)
    files.sync_dir()
    threshold = max(config.touch_persist_s, 1e-9)
    stale = {h for h, loc in index.locs.items() if loc.meta.expiry - loc.durable_expiry >= threshold}
    stats.ssd_rebuild_records += num_records
    stats.ssd_rebuild_s = time.perf_counter() - started
    logger.info("block store %s: %d records in %d segments indexed in %.3f s (%d blocks)", config.directory,
                num_records, len(files.segments), stats.ssd_rebuild_s, len(index))
    return stale


def _replay(index: SsdIndex, segment_id: int, offset: int, header: RecordHeader) -> None:
    block_hash = header.block_hash
    loc = index.get(block_hash)
    if header.kind == KIND_BLOCK:
        meta = header.meta()
        if loc is not None:
            meta.merge(loc.meta)
        index.set_block(block_hash, segment_id, offset, header.length, meta, header.expiry)
    elif loc is not None and header.expiry > loc.durable_expiry:
        index.set_touch(block_hash, segment_id, offset, header.meta())
    elif loc is not None:
        index.update_meta(block_hash, header.meta())
