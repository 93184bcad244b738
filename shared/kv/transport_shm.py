"""``shm`` KV transport (same host): the payload is copied into a POSIX shared-memory segment from a pool.

Segment layout: [HEADER_BYTES header | capacity payload bytes]; header = uint64[3] (magic, token, nbytes).
Handle: {"transport": "shm", "segment": name, "token": int, "offset": HEADER_BYTES, "nbytes", "dtype", "shape"}.

Invariants:
- Segments are created, pre-touched (zero-filled, so no transfer pays first-touch page faults) and unlinked
  only by the sender (pool trim or ``close``). The receiver maps them with ``shm_open`` + ``mmap`` and never
  registers them with ``multiprocessing.resource_tracker``: it can neither unlink nor "leak-warn" them.
- Capacities are powers of two (>= ``min_segment_bytes``); free segments are reused by size class, and
  the free pool is trimmed to ``max_pool_bytes``.
- ``stage`` copies the payload in; ``stage_blocks`` gathers ``kv_cache[block_ids]`` straight into the
  segment (one copy, no intermediate tensor; a device cache: gathered on its device, then one device -> host
  copy straight into the segment). Either writes the token into the header after the bytes;
  ``release`` (and segment destruction) zeroes it first. The receiver checks the token before and after
  copying, so a released or reused segment fails with TRANSFER_FAILED instead of yielding other bytes.
- Receiver mappings are cached (LRU, ``max_attached`` segments). A fetch pins the mapping it reads
  (refcount) from before the token check until after its copy: eviction skips pinned mappings, and a
  mapping dropped while pinned (stale token, ``close``) is unmapped when its last user unpins, never under
  a running copy. The cache may exceed ``max_attached`` only while more than that many are pinned; it is
  trimmed back as fetches finish.
- Copies of >= ``THREAD_COPY_BYTES`` run in a worker thread that is always waited for, even by a cancelled
  caller; ``close`` never destroys a segment a ``stage`` is still filling (that stage destroys it after).
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
from collections import OrderedDict
from multiprocessing import shared_memory

import numpy as np
import torch

from shared.errors import DeepinferError
from shared.kv.transport import (THREAD_COPY_BYTES, KVTransport, handle_fields, as_bytes, check_blocks,
                                 check_payload, dtype_name, gather_blocks_into, host_copy_, in_thread,
                                 transfer_failed, write_parts)

try:  # POSIX shm_open without resource_tracker registration (SharedMemory(track=False) is 3.13+).
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

log = logging.getLogger(__name__)

HEADER_BYTES = 4096             # one page: payload stays page-aligned
MAGIC = 0x4B56534D44494E46      # "KVSMDINF"


def size_class(nbytes: int, minimum: int) -> int:
    """Smallest power of two >= max(nbytes, minimum)."""
    n = max(nbytes, minimum, 1)
    return 1 << (n - 1).bit_length()


async def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src (same shape and dtype, host memory); big copies off the event loop."""
    if dst.numel() * dst.element_size() >= THREAD_COPY_BYTES:
        await in_thread(host_copy_, dst, src)
    else:
        host_copy_(dst, src)


class _Segment:
    """A sender-owned segment. ``header``: uint64[3] view; ``data``: uint8 [capacity] view."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.shm = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + capacity)
        self.name = self.shm.name
        self.header = np.frombuffer(self.shm.buf, dtype=np.uint64, count=3)
        self.data = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=capacity, offset=HEADER_BYTES)
        self.data.numpy().fill(0)              # pre-touch every page now, not during a transfer (numpy: see host_copy_)
        self.header[:] = (MAGIC, 0, 0)

    def destroy(self) -> None:
        self.header[1] = 0                     # receivers still mapping it must not accept old handles
        del self.header, self.data             # drop buffer exports, or close() raises BufferError
        try:
            self.shm.close()
        finally:
            self.shm.unlink()


class _Mapping:
    """A receiver-side mapping of someone else's segment (not tracked, never unlinked here).

    ``users``: fetches currently reading it (pins); ``dropped``: no longer cached, unmap when ``users`` is 0.
    """

    def __init__(self, name: str) -> None:
        if _posixshmem is None:  # pragma: no cover
            raise transfer_failed("shm transport needs POSIX shared memory")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise transfer_failed(f"shm segment {name!r} does not exist (released or sender gone)") from None
        except OSError as exc:
            raise transfer_failed(f"cannot open shm segment {name!r}: {exc}") from None
        try:
            self.size = os.fstat(fd).st_size
            if self.size < HEADER_BYTES:
                raise transfer_failed(f"shm segment {name!r} is too small ({self.size} B)")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)   # prefault our page tables once
            self.mm = mmap.mmap(fd, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self.mm, dtype=np.uint64, count=3)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, count=self.size - HEADER_BYTES,
                                     offset=HEADER_BYTES)
        self.users = 0
        self.dropped = False

    def close(self) -> None:
        """Unmap now; only when no fetch uses it (``users == 0``): tensors over ``mm`` do not keep it mapped."""
        del self.header, self.data
        self.mm.close()

    def drop(self) -> None:
        """No longer cached: unmap now if unused, else when the last user unpins."""
        self.dropped = True
        if self.users == 0:
            self.close()


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self, nc, worker_id: str, *, min_segment_bytes: int = 256 << 10, max_pool_bytes: int | None = None,
                 max_attached: int = 16, **kwargs) -> None:
        super().__init__(nc, worker_id, **kwargs)
        self.min_segment_bytes = min_segment_bytes
        self.max_pool_bytes = self.budget.max_bytes if max_pool_bytes is None else max_pool_bytes
        self.max_attached = max_attached
        self._free: dict[int, list[_Segment]] = {}          # capacity -> free segments
        self._staged: dict[str, tuple[_Segment, int]] = {}  # transfer_id -> (segment, nbytes)
        self._filling: set[str] = set()                     # transfer ids whose segment a copy is writing
        self._attached: OrderedDict[str, _Mapping] = OrderedDict()

    # ---------------------------------------------------------------- sender
    def pool_stats(self) -> dict:
        """Sender accounting: staged transfers/bytes, free segments and their capacity."""
        free = [s for segs in self._free.values() for s in segs]
        return {"staged": len(self._staged), "staged_bytes": self.staged_bytes, "free_segments": len(free),
                "free_bytes": sum(s.capacity for s in free),
                "staged_capacity": sum(s.capacity for s, _ in self._staged.values())}

    async def warm(self, nbytes: int, count: int = 1) -> int:
        """Pool ``count`` more free segments able to hold ``nbytes`` (made, and their pages touched, on a thread),
        so the first transfers of that size do not create them; returns how many were pooled (within
        ``max_pool_bytes``)."""
        cap = size_class(nbytes, self.min_segment_bytes)
        segments = await asyncio.to_thread(lambda: [_Segment(cap) for _ in range(count)])
        before = self.pool_stats()["free_segments"]
        for seg in segments:
            self._put_free(seg)
        return self.pool_stats()["free_segments"] - before

    async def _take_segment(self, nbytes: int) -> _Segment:
        cap = size_class(nbytes, self.min_segment_bytes)
        for c in sorted(k for k in self._free if cap <= k <= 4 * cap):   # exact class, else a slightly larger one
            if self._free[c]:
                return self._free[c].pop()
        log.debug("shm: new segment of %d B for %d B payload", cap, nbytes)
        if cap >= THREAD_COPY_BYTES:                          # zero-filling a big segment takes milliseconds
            return await asyncio.to_thread(_Segment, cap)
        return _Segment(cap)

    def _put_free(self, seg: _Segment) -> None:
        if self.pool_stats()["free_bytes"] + seg.capacity > self.max_pool_bytes or self.closed:
            seg.destroy()
        else:
            self._free.setdefault(seg.capacity, []).append(seg)

    async def stage(self, payload: torch.Tensor, transfer_id: str) -> dict:
        payload = check_payload(payload)                      # [n, *block_shape] contiguous CPU
        src = as_bytes(payload)
        return await self._stage_into(transfer_id, payload.dtype, list(payload.shape),
                                      lambda dst: _copy(dst, src))

    async def stage_parts(self, parts: list, dtype: torch.dtype, shape: list[int], transfer_id: str) -> dict:
        """The parts written straight into the segment (one copy each; big runs on a thread)."""
        async def fill(dst: torch.Tensor) -> None:
            if dst.numel() >= THREAD_COPY_BYTES:
                await in_thread(write_parts, dst, parts)
            else:
                write_parts(dst, parts)

        return await self._stage_into(transfer_id, dtype, [int(d) for d in shape], fill)

    async def stage_blocks(self, kv_cache: torch.Tensor, block_ids, transfer_id: str) -> dict:
        """Gather ``kv_cache[block_ids]`` straight into the segment: one copy, no intermediate host tensor
        (a device cache: gathered on its device, then one device -> host copy into the segment)."""
        cache, ids = check_blocks(kv_cache, block_ids)        # [num_blocks, *block_shape], [n]
        shape = [int(ids.numel()), *cache.shape[1:]]

        async def gather(dst: torch.Tensor) -> None:
            out = dst.view(cache.dtype).view(shape)           # [n, *block_shape] inside the segment
            if dst.numel() >= THREAD_COPY_BYTES:
                await in_thread(gather_blocks_into, cache, ids, out)
            else:
                gather_blocks_into(cache, ids, out)

        return await self._stage_into(transfer_id, cache.dtype, shape, gather)

    async def _stage_into(self, transfer_id: str, dtype: torch.dtype, shape: list[int], fill) -> dict:
        """Reserve budget and a segment, ``await fill(seg bytes [nbytes])``, publish the token."""
        self._check_open()
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        await self._reserve(transfer_id, nbytes)
        try:
            seg = await self._take_segment(nbytes)
        except BaseException as exc:
            await self.budget.release(nbytes)
            if isinstance(exc, (DeepinferError, asyncio.CancelledError)):
                raise
            raise transfer_failed(f"cannot create shm segment for {nbytes} B: {exc}") from exc
        self._staged[transfer_id] = (seg, nbytes)
        self._filling.add(transfer_id)                       # close() leaves this segment to us
        try:
            if nbytes:
                await fill(seg.data[:nbytes])
        except BaseException:
            await self.release(transfer_id)
            raise
        finally:
            self._filling.discard(transfer_id)
        if self.closed:                                       # closed while we filled: destroy it now
            await self.release(transfer_id)
            self._check_open()
        token = secrets.randbits(63) | 1
        seg.header[2] = nbytes
        seg.header[1] = token                                 # publish only after the bytes are in place
        return {"transport": self.name, "segment": seg.name, "token": token, "offset": HEADER_BYTES,
                "nbytes": nbytes, "dtype": dtype_name(dtype), "shape": shape}

    async def release(self, transfer_id: str) -> None:
        entry = self._staged.pop(transfer_id, None)
        if entry is None:
            return
        seg, nbytes = entry
        seg.header[1] = 0                                     # invalidate outstanding handles first
        self._put_free(seg)
        await self.budget.release(nbytes)

    # ---------------------------------------------------------------- receiver
    def _pin(self, name: str) -> _Mapping:
        """The cached mapping of segment ``name`` (attached if needed), pinned until ``_unpin``."""
        m = self._attached.get(name)
        if m is None:
            m = self._attached[name] = _Mapping(name)
        self._attached.move_to_end(name)
        m.users += 1
        self._trim()
        return m

    def _unpin(self, m: _Mapping) -> None:
        m.users -= 1
        if m.dropped:
            m.drop()                                          # unmaps once the last user is gone
        else:
            self._trim()

    def _trim(self) -> None:
        """Drop least recently used unpinned mappings until at most ``max_attached`` remain."""
        excess = len(self._attached) - self.max_attached
        for name in [n for n, m in self._attached.items() if m.users == 0][:max(excess, 0)]:
            self._attached.pop(name).drop()

    def _detach(self, name: str) -> None:
        m = self._attached.pop(name, None)
        if m is not None:
            m.drop()

    async def fetch(self, handle: dict, out: torch.Tensor | None = None, timeout: float = 10.0) -> torch.Tensor:
        """Copy the staged bytes out of the sender's segment. Local memory only: bounded by the copy itself."""
        result, nbytes = self._fetch_target(handle, out)
        if nbytes == 0:
            return result
        name, token, offset = handle_fields(handle, "shm", segment=str, token=int, offset=int)
        if offset != HEADER_BYTES:
            raise transfer_failed(f"shm handle offset {offset} != {HEADER_BYTES} (version mismatch?)")
        m = self._pin(name)
        try:
            if int(m.header[0]) != MAGIC or int(m.header[1]) != token or int(m.header[2]) != nbytes:
                self._detach(name)  # a stale mapping of a recycled name must not linger
                raise transfer_failed(f"shm segment {name!r} no longer holds transfer token {token} "
                                      "(released, reused or not a deepinfer segment)")
            if m.data.numel() < nbytes:
                raise transfer_failed(f"shm segment {name!r} holds {m.data.numel()} B < {nbytes} B")
            await _copy(as_bytes(result), m.data[:nbytes])
            if int(m.header[1]) != token:
                raise transfer_failed(f"shm segment {name!r} was released while it was being read")
        finally:
            self._unpin(m)
        return result

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for tid in [t for t in self._staged if t not in self._filling]:
            seg, nbytes = self._staged.pop(tid)
            seg.destroy()
            await self.budget.release(nbytes)
        for segs in self._free.values():
            for seg in segs:
                seg.destroy()
        self._free.clear()
        for name in list(self._attached):
            self._detach(name)
