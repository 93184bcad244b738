"""KV transports against a real nats-server: exact round trips, release/accounting, bounded failures.

Sender and receiver always use separate transport instances on SEPARATE NATS connections (as two workers
would); shm's receiver-side specifics (another process, pinned mappings) are in test_kv_shm.py.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import zlib

import pytest
import torch

from shared.errors import DeepinferError, ErrorCode
from shared.kv.registry import available_transports, make_transport
from shared.nats_server import start_embedded_server

TRANSPORTS = available_transports()
# fetch() yields a host tensor on these; cuda_ipc yields a GPU tensor and needs a second process
# (tests/gpu/test_cuda_paths.py), so the shared contract tests below run on these only.
HOST_TRANSPORTS = [t for t in TRANSPORTS if t != "cuda_ipc"]
MIB = 1 << 20


def kv(shape, dtype, seed=0) -> torch.Tensor:
    """A random KV payload [n, L, 2, bs, kvh, D]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())


@pytest.fixture(params=HOST_TRANSPORTS)
async def pair(request, nc, nc2):
    """(sender, receiver) of one transport, on two different NATS connections."""
    opts = {"stream": {"chunk_bytes": 1 * MIB}}.get(request.param, {})
    tx = make_transport(request.param, nc, "tx", **opts)
    rx = make_transport(request.param, nc2, "rx", **opts)
    try:
        yield tx, rx
    finally:
        await tx.close()
        await rx.close()
        assert tx.staged_bytes == 0


def assert_transfer_failed(exc_info) -> None:
    assert isinstance(exc_info.value, DeepinferError)
    assert exc_info.value.code is ErrorCode.TRANSFER_FAILED


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2, 2, 16, 2, 8), (7, 3, 2, 16, 4, 32), (3, 5, 2, 3, 1, 5)])
async def test_round_trip_exact(pair, shape, dtype):
    tx, rx = pair
    payload = kv(shape, dtype)
    handle = await tx.stage(payload, "rt-1")
    assert handle["dtype"] == str(dtype).removeprefix("torch.") and handle["shape"] == list(shape)
    assert handle["nbytes"] == payload.numel() * payload.element_size()
    got = await rx.fetch(handle, timeout=10)
    assert got.dtype == dtype and torch.equal(got, payload)
    out = torch.zeros(shape, dtype=dtype)                       # matching `out` is filled in place
    got2 = await rx.fetch(handle, out=out, timeout=10)
    assert got2.data_ptr() == out.data_ptr() and torch.equal(out, payload)
    wrong = torch.zeros(1, dtype=dtype)                          # non-matching `out` is ignored
    assert torch.equal(await rx.fetch(handle, out=wrong, timeout=10), payload)
    await tx.release("rt-1")


async def test_round_trip_64mib(pair):
    tx, rx = pair
    payload = kv((128, 16, 2, 16, 8, 64), torch.float16)         # 64 MiB
    assert payload.numel() * 2 == 64 * MIB
    handle = await tx.stage(payload, "big")
    got = await rx.fetch(handle, timeout=30)
    assert torch.equal(got, payload)
    await tx.release("big")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
async def test_stage_blocks_gathers_exactly(pair, dtype):
    tx, rx = pair
    cache = kv((20, 3, 2, 16, 2, 32), dtype)                     # [num_blocks, L, 2, bs, kvh, D]
    for i, ids in enumerate(([5, 2, 17, 9], [0], list(range(19, -1, -1)))):
        handle = await tx.stage_blocks(cache, ids, f"blocks-{i}")
        assert handle["shape"] == [len(ids), 3, 2, 16, 2, 32]
        assert torch.equal(await rx.fetch(handle, timeout=10), cache[ids])
        await tx.release(f"blocks-{i}")
    assert tx.staged_bytes == 0
    with pytest.raises(DeepinferError) as ei:
        await tx.stage_blocks(cache, [3, 20], "out-of-range")
    assert_transfer_failed(ei)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
async def test_stage_blocks_from_a_cuda_cache(pair, dtype):
    """A GPU engine's cache: gathered on the device, copied to the host once, fetched exactly."""
    tx, rx = pair
    cache = kv((80, 4, 2, 4, 16, 64), torch.float32).to("cuda", dtype)  # [num_blocks, L, 2, kvh, bs, D], 64 KiB each
    for i, ids in enumerate(([5, 2, 17, 9], list(range(79, -1, -1)))):  # 256 KiB; 5 MiB (a thread copy)
        handle = await tx.stage_blocks(cache, ids, f"cuda-{i}")
        assert handle["shape"] == [len(ids), 4, 2, 4, 16, 64]
        got = await rx.fetch(handle, timeout=10)
        assert got.device.type == "cpu" and torch.equal(got, cache[ids].cpu())
        await tx.release(f"cuda-{i}")
    assert tx.staged_bytes == 0


async def test_empty_payload(pair):
    tx, rx = pair
    payload = torch.empty((0, 2, 2, 16, 2, 8), dtype=torch.float16)
    got = await rx.fetch(await tx.stage(payload, "empty"), timeout=5)
    assert got.shape == payload.shape
    await tx.release("empty")


async def test_many_transfers_in_flight(pair):
    tx, rx = pair
    payloads = [kv((i + 1, 2, 2, 16, 2, 8), torch.float32, seed=i) for i in range(6)]
    handles = [await tx.stage(p, f"m{i}") for i, p in enumerate(payloads)]
    got = await asyncio.gather(*(rx.fetch(h, timeout=10) for h in reversed(handles)))
    for p, g in zip(reversed(payloads), got):
        assert torch.equal(p, g)
    for i in range(6):
        await tx.release(f"m{i}")
    assert tx.staged_bytes == 0


# ------------------------------------------------------------------------------------------- release & failures
async def test_release_idempotent_and_frees_staging(pair):
    tx, rx = pair
    a, b = kv((4, 2, 2, 16, 2, 8), torch.float16), kv((2, 2, 2, 16, 2, 8), torch.float16, seed=1)
    ha = await tx.stage(a, "a")
    hb = await tx.stage(b, "b")
    assert tx.staged_bytes == a.nbytes + b.nbytes
    await tx.release("a")
    await tx.release("a")
    await tx.release("never-staged")
    assert tx.staged_bytes == b.nbytes
    assert torch.equal(await rx.fetch(hb, timeout=5), b)
    await tx.release("b")
    assert tx.staged_bytes == 0
    if tx.name == "shm":
        stats = tx.pool_stats()
        assert stats["staged"] == 0 and stats["staged_capacity"] == 0 and stats["free_segments"] == 2
        h = await tx.stage(a, "again")                           # reuses a pooled segment
        assert tx.pool_stats()["free_segments"] == 1 and h["segment"] in {ha["segment"], hb["segment"]}
        await tx.release("again")


async def test_same_transfer_id_twice_is_rejected(pair):
    tx, _ = pair
    p = kv((1, 2, 2, 16, 2, 8), torch.float16)
    await tx.stage(p, "dup")
    with pytest.raises(DeepinferError) as ei:
        await tx.stage(p, "dup")
    assert_transfer_failed(ei)
    await tx.release("dup")


async def test_fetch_released_handle_fails_fast(pair):
    tx, rx = pair
    handle = await tx.stage(kv((2, 2, 2, 16, 2, 8), torch.float32), "gone")
    await tx.release("gone")
    t0 = time.monotonic()
    with pytest.raises(DeepinferError) as ei:
        await rx.fetch(handle, timeout=3)
    assert_transfer_failed(ei)
    assert time.monotonic() - t0 < 3.5


def bogus(handle: dict) -> dict:
    h = dict(handle)
    for key, value in {"segment": "psm_deepinfer_nope", "subject": "di.v1.kv.nobody.pull.here",
                       "agent": "nobody", "token": 12345}.items():
        if key in h:
            h[key] = value
    return h


async def test_fetch_unknown_or_malformed_handle_fails_fast(pair):
    tx, rx = pair
    handle = await tx.stage(kv((2, 2, 2, 16, 2, 8), torch.float32), "real")
    for h in (bogus(handle), {**handle, "nbytes": handle["nbytes"] + 1}, {**handle, "dtype": "complex7"},
              {"transport": tx.name}, "not a dict"):
        t0 = time.monotonic()
        with pytest.raises(DeepinferError) as ei:
            await rx.fetch(h, timeout=3)
        assert_transfer_failed(ei)
        assert time.monotonic() - t0 < 3.5
    assert torch.equal(await rx.fetch(handle, timeout=5), kv((2, 2, 2, 16, 2, 8), torch.float32))
    await tx.release("real")


async def test_staging_bound(nc):
    for name in TRANSPORTS:
        tx = make_transport(name, nc, "bounded", max_staged_bytes=1 * MIB, stage_timeout=0.3)
        try:
            big = torch.zeros(2 * MIB, dtype=torch.uint8)
            with pytest.raises(DeepinferError) as ei:               # larger than the bound: fails at once
                await tx.stage(big, "too-big")
            assert_transfer_failed(ei)
            await tx.stage(torch.zeros(768 << 10, dtype=torch.uint8), "a")
            t0 = time.monotonic()
            with pytest.raises(DeepinferError) as ei:               # no room: waits stage_timeout, then fails
                await tx.stage(torch.zeros(512 << 10, dtype=torch.uint8), "b")
            assert_transfer_failed(ei)
            assert 0.25 < time.monotonic() - t0 < 2.0
            waiting = asyncio.ensure_future(tx.stage(torch.zeros(512 << 10, dtype=torch.uint8), "c"))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            await tx.release("a")                                    # room appears: the waiter proceeds
            handle = await asyncio.wait_for(waiting, 2)
            assert handle["nbytes"] == 512 << 10 and tx.staged_bytes == 512 << 10
        finally:
            await tx.close()
        assert tx.staged_bytes == 0


async def test_closed_transport_refuses(nc):
    tx = make_transport("shm", nc, "closing")
    await tx.close()
    await tx.close()
    with pytest.raises(DeepinferError):
        await tx.stage(torch.zeros(4), "x")


def test_registry():
    assert {"shm", "stream", "tcp"} <= set(TRANSPORTS)
    assert TRANSPORTS == [t for t in ("shm", "stream", "tcp", "nixl", "cuda_ipc") if t in TRANSPORTS]
    with pytest.raises(DeepinferError) as ei:
        make_transport("carrier-pigeon", None, "w")
    assert ei.value.code is ErrorCode.INVALID_REQUEST
    if "cuda_ipc" not in TRANSPORTS:
        with pytest.raises(DeepinferError) as ei:
            make_transport("cuda_ipc", None, "w")
        assert ei.value.code is ErrorCode.TRANSFER_FAILED


def test_registry_is_not_in_the_transport_base():
    """Layering: the base module imports no transport; the registry imports the transports (no cycle)."""
    import shared.kv.transport as base
    assert not hasattr(base, "make_transport") and not hasattr(base, "available_transports")
    code = ("import sys, shared.kv.transport; "
            "assert not [m for m in sys.modules if m.startswith('shared.kv.transport_')], 'base imports a transport'; "
            "import shared.kv.registry")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------------------------------- stream specifics
async def test_stream_slow_consumer_completes(nc, nc2):
    tx = make_transport("stream", nc, "tx", chunk_bytes=256 << 10)
    rx = make_transport("stream", nc2, "rx", max_inflight=1)
    pull = rx._pull

    async def slow_pull(subject, i, deadline):
        await asyncio.sleep(0.05)                                # a consumer busy between chunks
        return await pull(subject, i, deadline)

    rx._pull = slow_pull
    try:
        payload = kv((64, 4, 2, 16, 4, 64), torch.float16)       # 4 MiB = 16 chunks
        handle = await tx.stage(payload, "slow")
        assert handle["chunks"] == 16
        assert torch.equal(await rx.fetch(handle, timeout=10), payload)
    finally:
        await tx.close()
        await rx.close()


async def test_stream_retries_a_lost_chunk_then_gives_up(nc, nc2):
    tx = make_transport("stream", nc, "tx", chunk_bytes=64 << 10)
    rx = make_transport("stream", nc2, "rx", request_timeout=0.2, retries=2)
    serve, dropped = tx._serve, []

    async def lossy_serve(entry, msg):
        if not dropped:                                          # the first request is lost
            dropped.append(msg)
            return
        await serve(entry, msg)

    async def black_hole(entry, msg):
        dropped.append(msg)

    tx._serve = lossy_serve
    try:
        payload = kv((4, 4, 2, 16, 4, 64), torch.float16)        # 256 KiB = 4 chunks
        assert torch.equal(await rx.fetch(await tx.stage(payload, "lossy"), timeout=5), payload)
        assert len(dropped) == 1
        tx._serve = black_hole
        handle = await tx.stage(payload, "black-hole")
        t0 = time.monotonic()
        with pytest.raises(DeepinferError) as ei:
            await rx.fetch(handle, timeout=5)
        assert_transfer_failed(ei)
        assert 0.5 < time.monotonic() - t0 < 2.0                 # 3 attempts x 0.2 s, not the full timeout
    finally:
        await tx.close()
        await rx.close()


# ------------------------------------------------------------------------------------------- server helper
def test_embedded_server_restart_keeps_url():
    server = start_embedded_server()
    try:
        url = server.url
        server.restart()
        assert server.url == url and server.proc is not None and server.proc.poll() is None
    finally:
        server.stop()
        server.stop()
    assert server.proc is None


async def test_stage_parts_joins_bytes_exactly(pair):
    """``stage_parts`` (a tier's stored blocks, staged without a payload tensor): the receiver gets the parts'
    concatenation as one payload; parts that do not fill the shape exactly are refused."""
    tx, rx = pair
    payload = kv((5, 3, 2, 16, 2, 8), torch.float16)
    raw = payload.view(-1).view(torch.uint8).numpy().tobytes()
    cuts = [0, 10, 4096, 4097, len(raw)]
    parts = [raw[a:b] for a, b in zip(cuts, cuts[1:])]
    handle = await tx.stage_parts(parts, torch.float16, list(payload.shape), "parts")
    assert torch.equal(await rx.fetch(handle, timeout=10), payload)
    await tx.release("parts")
    for bad in (parts[:-1], parts + [b"x"]):
        with pytest.raises(DeepinferError) as ei:
            await tx.stage_parts(bad, torch.float16, list(payload.shape), "bad")
        assert_transfer_failed(ei)
    assert tx.staged_bytes == 0
