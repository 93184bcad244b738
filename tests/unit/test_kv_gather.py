"""KV block gathering for ``stage_blocks`` on CPU: the host path, the device path's two steps (run here on a
CPU cache), block-id validation, and ``in_thread`` keeping a cancelled caller until its thread ends."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from shared.errors import DeepinferError, ErrorCode
from shared.kv.transport import (THREAD_COPY_BYTES, check_blocks, gather_blocks_into, gather_via_device,
                                 host_blocks, host_copy_, in_thread)

IDS = [5, 2, 17, 9, 0]


def cache(num_blocks: int = 20, dtype=torch.float16) -> torch.Tensor:
    """A block-major cache [num_blocks, L, 2, kvh, bs, D]."""
    g = torch.Generator().manual_seed(0)
    return torch.randn((num_blocks, 3, 2, 2, 16, 8), generator=g).to(dtype)


def test_check_blocks_returns_host_int64_ids_and_validates():
    c = cache()
    got, ids = check_blocks(c, torch.tensor(IDS, dtype=torch.int32))
    assert got is c and ids.dtype == torch.int64 and ids.device.type == "cpu" and ids.tolist() == IDS
    for bad_cache, bad_ids in ((c, [3, 20]), (c, [-1]), (c.transpose(0, 1), [0]), ("cache", [0])):
        with pytest.raises(DeepinferError) as ei:
            check_blocks(bad_cache, bad_ids)
        assert ei.value.code is ErrorCode.TRANSFER_FAILED


@pytest.mark.parametrize("gather", [gather_blocks_into, gather_via_device])
def test_gather_fills_the_staging_view_in_place(gather):
    c = cache()
    _, ids = check_blocks(c, IDS)
    staging = torch.zeros(4096 + c[0].nbytes * len(IDS), dtype=torch.uint8)   # like an shm segment
    out = staging[4096:].view(c.dtype).view(len(IDS), *c.shape[1:])            # [n, *block_shape]
    assert gather(c, ids, out) is out
    assert torch.equal(out, c[IDS]) and out.data_ptr() == staging[4096:].data_ptr()
    assert not staging[:4096].any()                                            # nothing outside the view


async def test_host_blocks_is_a_new_contiguous_host_tensor():
    c = cache()
    _, ids = check_blocks(c, IDS)
    got = await host_blocks(c, ids)
    assert got.device.type == "cpu" and got.is_contiguous() and torch.equal(got, c[IDS])
    assert got.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    empty = await host_blocks(c, check_blocks(c, [])[1])
    assert list(empty.shape) == [0, *c.shape[1:]]


async def test_in_thread_outlives_a_cancelled_caller():
    started, finished = threading.Event(), threading.Event()

    def slow() -> int:
        started.set()
        time.sleep(0.3)
        finished.set()
        return 7

    assert await in_thread(lambda: 3) == 3
    task = asyncio.ensure_future(in_thread(slow))
    while not started.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set(), "the caller returned while its thread was still running"
    with pytest.raises(ZeroDivisionError):
        await in_thread(lambda: 1 / 0)


def test_thread_copy_threshold_is_shared():
    from shared.kv import transport_shm
    assert transport_shm.THREAD_COPY_BYTES == THREAD_COPY_BYTES == 4 << 20


def _threads() -> set[str]:
    import os
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_host_copies_start_no_thread_pool_on_the_calling_thread():
    """A torch copy on a fresh thread starts an OpenMP pool there (torch's threads - 1 new threads, alive as long
    as that thread); the host gather, copy and shm segment fill must not (a worker keeps one pool: its engine
    thread's)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        c = cache(num_blocks=64, dtype=torch.float32)  # 64 x 6 KiB: past torch's parallel grain
        ids = torch.arange(63, -1, -1)
        out = torch.empty((64, *c.shape[1:]), dtype=c.dtype)

        def grown_by(copy) -> int:
            done, measured = threading.Event(), []

            def run():
                before = _threads()
                copy()
                measured.append(len(_threads() - before))  # threads started meanwhile (others may end)
                done.set()
            t = threading.Thread(target=run)
            t.start()
            done.wait(10)
            t.join(10)
            return measured[0]

        assert grown_by(lambda: torch.index_select(c, 0, ids, out=out)) >= 1  # the check can see a pool start
        assert grown_by(lambda: gather_blocks_into(c, ids, out)) == 0
        assert torch.equal(out, c[ids])
        dst = torch.empty_like(c)
        assert grown_by(lambda: host_copy_(dst, c)) == 0
        assert torch.equal(dst, c)
        from shared.kv.transport_shm import _Segment
        segments = []
        assert grown_by(lambda: segments.append(_Segment(1 << 20))) == 0  # its pages are zero-filled up front
        assert int(segments[0].data.sum()) == 0
        segments[0].destroy()
    finally:
        torch.set_num_threads(previous)


def test_host_gather_handles_other_dtypes_and_no_blocks():
    c = cache(dtype=torch.bfloat16)
    ids = torch.tensor(IDS)
    out = torch.empty((len(IDS), *c.shape[1:]), dtype=c.dtype)
    assert torch.equal(gather_blocks_into(c, ids, out), c[ids])
    empty = torch.empty((0, *c.shape[1:]), dtype=c.dtype)
    assert gather_blocks_into(c, torch.zeros(0, dtype=torch.int64), empty).shape[0] == 0
