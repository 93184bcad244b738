"""The SSD tier's segment files: a directory of append-only logs ``seg-<id>.log``, one of them active.

Not thread-safe: ``SsdTier`` calls it under its lock. All methods block on file I/O.

Invariants:
- Segment ids only grow; records are only ever appended to the active segment (the highest id), which is
  sealed (fsynced unless ``fsync == "never"``) when the next record would push it past ``segment_bytes``.
  So no segment exceeds ``segment_bytes`` and only the active one can have a torn tail after a crash.
- ``disk_bytes`` == the sum of the segment files' sizes as this process wrote them.
- An append is all or nothing: a failed write is truncated away before the error propagates.
- At most ``MAX_READ_FDS`` read descriptors are open (LRU), plus the active segment's write descriptor.
"""
from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_READ_FDS = 64
_NAME = re.compile(r"seg-(\d{8,})\.log")


@dataclass(slots=True)
class Segment:
    segment_id: int
    path: Path
    size: int


class SegmentFiles:
    def __init__(self, directory: Path, segment_bytes: int, fsync: str) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.segments: dict[int, Segment] = {}
        self.active: Segment | None = None
        self.disk_bytes = 0
        self._write_fd = -1
        self._unsynced = False
        self._read_fds: OrderedDict[int, int] = OrderedDict()

    def existing(self) -> list[tuple[int, Path]]:
        """Segment files found in the directory, oldest first."""
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _NAME.fullmatch(p.name))]
        return sorted(found)

    def adopt(self, segment_id: int, path: Path, size: int) -> None:
        """Register an existing (sealed) segment of ``size`` valid bytes."""
        self.segments[segment_id] = Segment(segment_id, path, size)
        self.disk_bytes += size

    def start_active(self) -> None:
        """Seal the active segment (if any) and create the next one."""
        if self.active is not None:
            self.sync()
            os.close(self._write_fd)
            self._write_fd = -1
        segment_id = max(self.segments, default=0) + 1
        path = self.directory / f"seg-{segment_id:08d}.log"
        self._write_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.active = self.segments[segment_id] = Segment(segment_id, path, 0)
        self.sync_dir()

    def append(self, record: bytes) -> tuple[int, int]:
        """Append one record to the active segment (rotating first if it would not fit): (segment, offset)."""
        if self.active is None or self.active.size + len(record) > self.segment_bytes:
            self.start_active()
        seg = self.active
        offset = seg.size
        view = memoryview(record)
        try:
            while view:
                view = view[os.write(self._write_fd, view):]
        except OSError:
            os.ftruncate(self._write_fd, offset)   # all or nothing
            raise
        seg.size += len(record)
        self.disk_bytes += len(record)
        self._unsynced = True
        if self.fsync == "always":
            self.sync()
        return seg.segment_id, offset

    def sync(self) -> None:
        """Make every appended record durable (per the fsync policy)."""
        if self._unsynced and self.fsync != "never":
            os.fsync(self._write_fd)
        self._unsynced = False

    def sync_dir(self) -> None:
        if self.fsync == "never":
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, segment_id: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of a segment (fewer if the file is shorter)."""
        fd = self._read_fds.pop(segment_id, None)
        if fd is None:
            fd = os.open(self.segments[segment_id].path, os.O_RDONLY)
            if len(self._read_fds) >= MAX_READ_FDS:
                os.close(self._read_fds.popitem(last=False)[1])
        self._read_fds[segment_id] = fd
        return os.pread(fd, length, offset)

    def delete(self, segment_id: int) -> int:
        """Remove a sealed segment file; returns its size."""
        if self.active is not None and segment_id == self.active.segment_id:
            raise AssertionError("the active segment cannot be deleted")
        seg = self.segments.pop(segment_id)
        fd = self._read_fds.pop(segment_id, None)
        if fd is not None:
            os.close(fd)
        seg.path.unlink()
        self.sync_dir()
        self.disk_bytes -= seg.size
        return seg.size

    def close(self) -> None:
        """Sync and close every descriptor; an empty active segment is removed. Idempotent."""
        if self._write_fd >= 0:
            self.sync()
            os.close(self._write_fd)
            self._write_fd = -1
            if self.active is not None and self.active.size == 0:
                self.segments.pop(self.active.segment_id, None)
                self.active.path.unlink(missing_ok=True)
            self.active = None
        while self._read_fds:
            os.close(self._read_fds.popitem()[1])
