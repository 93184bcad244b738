"""``shm`` transport specifics against a real nats-server: the receiver in another process (spawn), and
receiver mappings pinned while fetches copy from them (more concurrent fetches than the mapping LRU, cancels
and ``close`` during copies)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp

import torch

from shared.kv.registry import make_transport
from tests.integration.test_kv_transports import crc, kv


def _fetch_in_child(handle: dict) -> tuple[int, list[int]]:
    """Runs in a spawned process: fetch with a fresh receiver, return (crc, shape)."""
    from shared.kv.transport_shm import ShmTransport

    async def go():
        rx = ShmTransport(None, "child-rx")
        try:
            t = await rx.fetch(handle, timeout=10)
            return crc(t), list(t.shape)
        finally:
            await rx.close()

    return asyncio.run(go())


async def test_shm_receiver_in_another_process(nc):
    tx = make_transport("shm", nc, "tx")
    try:
        payloads = [kv((3, 4, 2, 16, 4, 32), torch.float16), kv((9, 2, 2, 16, 2, 64), torch.float32, seed=3)]
        handles = [await tx.stage(p, f"x{i}") for i, p in enumerate(payloads)]
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            loop = asyncio.get_running_loop()
            for p, h in zip(payloads, handles):
                got_crc, shape = await asyncio.wait_for(loop.run_in_executor(pool, _fetch_in_child, h), 120)
                assert got_crc == crc(p) and shape == list(p.shape)
        # The child's exit must not have unlinked the sender's segments (resource_tracker untouched).
        rx = make_transport("shm", nc, "rx")
        assert torch.equal(await rx.fetch(handles[0], timeout=5), payloads[0])
        await rx.close()
    finally:
        await tx.close()


async def test_shm_concurrent_fetches_pin_their_mappings(nc):
    """More concurrent fetches than ``max_attached`` over distinct segments, each copy in a thread: a fetch
    attaching a new segment must not unmap one another fetch is still copying from."""
    from shared.kv.transport_shm import THREAD_COPY_BYTES

    tx = make_transport("shm", nc, "tx")
    rx = make_transport("shm", nc, "rx", max_attached=2)
    try:
        payloads = [kv((32, 4, 2, 16, 4, 64), torch.float32, seed=i) for i in range(12)]   # 4 MiB each
        assert payloads[0].nbytes >= THREAD_COPY_BYTES
        handles = [await tx.stage(p, f"pin{i}") for i, p in enumerate(payloads)]
        assert len({h["segment"] for h in handles}) == 12
        got = await asyncio.gather(*(rx.fetch(h, timeout=30) for h in handles))
        for i, (p, g) in enumerate(zip(payloads, got)):
            assert torch.equal(g, p), f"fetch {i} returned other bytes"
        assert len(rx._attached) <= 2
        assert torch.equal(await rx.fetch(handles[0], timeout=5), payloads[0])   # evicted ones re-attach
    finally:
        await rx.close()
        await tx.close()


async def test_shm_cancel_and_close_during_copies(nc):
    """Cancelled fetches and a receiver ``close`` while thread copies run: nothing is unmapped under a copy."""
    tx = make_transport("shm", nc, "tx")
    rx = make_transport("shm", nc, "rx", max_attached=2)
    try:
        payloads = [kv((32, 4, 2, 16, 4, 64), torch.float32, seed=i) for i in range(8)]   # 4 MiB each
        handles = [await tx.stage(p, f"cc{i}") for i, p in enumerate(payloads)]
        tasks = [asyncio.ensure_future(rx.fetch(h, timeout=30)) for h in handles]
        await asyncio.sleep(0)                                   # every fetch attached and started its copy
        for t in tasks[::2]:
            t.cancel()
        await rx.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for i, r in enumerate(results):
            if i % 2:
                assert torch.equal(r, payloads[i]), f"fetch {i} returned other bytes"
            else:
                assert isinstance(r, asyncio.CancelledError), r
        assert not rx._attached
    finally:
        await rx.close()
        await tx.close()
