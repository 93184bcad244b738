"""Commit the DRAM tier's budget once, at start, so filling it never page-faults on the request path.

The DRAM tier keeps every block's payload as its own ``bytes`` (0.1–10 MB each). Without this, the first
``dram_bytes`` of puts each take fresh pages from the kernel: a page fault per 4 KiB, which on a VM with free
page reporting (memory handed back to the host and faulted in again) costs ~35 µs each, ~9 s of system time per
GiB, measured here as 6.5 s of the tier's CPU during one 64-request burst on 2 cores, time the engine's
OpenMP threads lost.

``reserve_heap(nbytes)`` makes glibc keep what it is given: one malloc arena for every thread (so a block
allocated on any thread reuses the same memory), blocks below 32 MiB from the heap rather than their own mmap,
and no trimming of the heap's free top; then it allocates ``nbytes`` in 16 MiB pieces, writes
one byte per page, and frees them. The freed heap stays mapped and backed, and later payload allocations are
carved from it without faults. The process's resident memory holds the budget from then on, as a buffer pool
does. Elsewhere than glibc it does nothing (``reserved`` is 0). It never raises: a reservation that cannot be
made is only logged.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8   # glibc malloc.h
MMAP_THRESHOLD = 32 << 20      # glibc's largest; blocks up to this come from the (kept) heap
PIECE = 16 << 20               # below MMAP_THRESHOLD: every piece comes from the heap
PAGE = 4096


@dataclass(slots=True)
class Reservation:
    reserved: int = 0          # bytes allocated, touched and freed back to the kept heap
    seconds: float = 0.0


def _glibc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc has it, musl does not
        libc.gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_heap() -> bool:
    """Configure glibc to keep freed heap (never trimmed); call before other threads start. False if not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_ARENA_MAX, 1) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(ok and libc.mallopt(M_TRIM_THRESHOLD, -1))   # -1: never trim (mallopt's int cannot hold > 2 GiB)


def reserve_heap(nbytes: int) -> Reservation:
    """Fault in ``nbytes`` of heap and free it, kept (``keep_heap``). Blocking: call it on the thread that will
    allocate the blocks (the cache tier's main thread, before its event loop starts)."""
    out = Reservation()
    if nbytes <= 0 or not keep_heap():
        return out
    t0 = time.perf_counter()
    pieces = []
    try:
        for _ in range(-(-nbytes // PIECE)):
            piece = bytearray(PIECE)                          # calloc: fresh heap is not written yet
            np.frombuffer(piece, dtype=np.uint8)[::PAGE] = 1  # one write per page backs it
            pieces.append(piece)
            out.reserved += PIECE
    except MemoryError:
        log.warning("DRAM reservation stopped at %d of %d MiB (out of memory)", out.reserved >> 20, nbytes >> 20)
    finally:
        del pieces
    out.seconds = time.perf_counter() - t0
    return out
