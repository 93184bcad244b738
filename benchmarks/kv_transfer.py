"""KV transfer between two processes on one host, per transport, against a plain in-process memcpy.

A sender process owns a KV cache [num_blocks, L, 2, bs, kvh, D] (fp16) whose blocks are 256 KiB-2 MiB;
per round it gathers 64 MiB worth of scattered blocks (``payload = kv_cache[block_ids]``) and stages them.
The receiver (this process) asks for a round over NATS, gets the handle, fetches into a preallocated
tensor (as a decode worker does into its staging), then tells the sender to release.

Reported per transport and block size (medians over ``--rounds`` after ``--warmup`` rounds):
- ``total``: request -> handle -> fetched: the sender's gather (``kv_cache[ids]``) and ``stage``, or
  ``stage_blocks`` (the transport gathers into its staging / reads blocks in place), the NATS round trip
  carrying the handle, and the receiver's ``fetch`` into a preallocated buffer.
- ``fetch``: the receiver's fetch alone. GB/s = bytes / time; ``vs copy`` = GB/s / torch-copy GB/s.
- ``cold``: the very first round (segment creation, UCX wire-up), not in the medians.
The baselines are one-process copies of the same bytes: ``torch copy_`` and ``numpy copyto`` (memcpy)
between preallocated contiguous tensors, and the gather ``kv_cache[block_ids]`` itself.
The benchmark starts its own nats-server (shared/nats_server.py). Usage:

    python -m benchmarks.kv_transfer [--transports shm,stream,nixl] [--rounds 8] [--mib 64]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack
import numpy as np
import torch

from shared import subjects
from shared.kv.registry import available_transports, make_transport
from shared.kv.transport import sync_with_server
from shared.nats_server import start_embedded_server

log = logging.getLogger("bench.kv")
MIB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 64          # fp16: one token of one layer's K or V = 512 B


def cache_shape(block_bytes: int, num_blocks: int) -> tuple[int, ...]:
    """[num_blocks, L, 2, bs, kvh, D] with bs chosen so that one block is ``block_bytes`` in fp16."""
    bs = block_bytes // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2)
    assert bs > 0 and bs * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 == block_bytes, block_bytes
    return (num_blocks, LAYERS, 2, bs, KV_HEADS, HEAD_DIM)


def ctl(op: str) -> str:
    return subjects.ctl("kvbench", op)


# ---------------------------------------------------------------------------------------------- sender process
def sender_main(url: str, transport: str, options: dict) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    asyncio.run(_sender(url, transport, options))


async def _sender(url: str, transport: str, options: dict) -> None:
    import nats
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=2)
    tx = make_transport(transport, nc, f"bench-tx-{transport}", **options)
    state: dict = {"cache": None}
    done = asyncio.Event()

    async def on_prepare(msg) -> None:
        req = msgpack.unpackb(msg.data)
        state["cache"] = torch.randn(cache_shape(req["block_bytes"], 2 * req["nblocks"])).half()
        await nc.publish(msg.reply, b"ok")

    async def on_stage(msg) -> None:
        req = msgpack.unpackb(msg.data)
        cache = state["cache"]
        ids = torch.randperm(cache.shape[0])[: req["nblocks"]]       # scattered blocks
        t0 = time.perf_counter()
        if req["mode"] == "blocks":                                   # the transport gathers (or reads in place)
            t1 = t0
            handle = await tx.stage_blocks(cache, ids, req["tid"])
        else:
            payload = cache[ids]                                      # [n, L, 2, bs, kvh, D] contiguous
            t1 = time.perf_counter()
            handle = await tx.stage(payload, req["tid"])
        t2 = time.perf_counter()
        crc = zlib.crc32(cache[ids].view(-1).view(torch.uint8).numpy()) if req.get("verify") else 0
        await nc.publish(msg.reply, msgpack.packb({"handle": handle, "gather_s": t1 - t0, "stage_s": t2 - t1,
                                                   "crc": crc}))

    async def on_release(msg) -> None:
        await tx.release(msgpack.unpackb(msg.data)["tid"])
        await nc.publish(msg.reply, b"ok")

    async def on_stop(msg) -> None:
        await nc.publish(msg.reply, b"ok")
        done.set()

    async def on_ping(msg) -> None:
        await nc.publish(msg.reply, b"pong")

    for op, cb in (("prepare", on_prepare), ("stage", on_stage), ("release", on_release), ("stop", on_stop),
                   ("ping", on_ping)):
        await nc.subscribe(ctl(op), cb=cb)
    await sync_with_server(nc, 5)
    try:
        await asyncio.wait_for(done.wait(), 3600)
    finally:
        await tx.close()
        await nc.drain()


# ---------------------------------------------------------------------------------------------- receiver (here)
async def run_transport(url: str, transport: str, block_sizes: list[int], total: int, rounds: int, warmup: int,
                        options: dict, spawn_sender: bool = True,
                        modes: tuple[str, ...] = ("payload", "blocks")) -> list[dict]:
    """Rounds against a sender process: spawned here, or (``spawn_sender=False``) one already serving on ``url``
    (on another simulated host: ``benchmarks/cross_host_kv.py``), which is stopped at the end either way."""
    import nats
    proc = mp.get_context("spawn").Process(target=sender_main, args=(url, transport, options), daemon=True)
    if spawn_sender:
        proc.start()
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=2)
    rx = make_transport(transport, nc, f"bench-rx-{transport}", **options)
    rows = []
    try:
        deadline = time.monotonic() + 120
        while True:  # the sender imports torch (and maybe NIXL/UCX) first
            try:
                await nc.request(ctl("ping"), b"", timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline or (spawn_sender and not proc.is_alive()):
                    raise RuntimeError(f"{transport} sender process did not come up")
                await asyncio.sleep(0.2)
        for mode, block_bytes in [(m, b) for m in modes for b in block_sizes]:
            nblocks = total // block_bytes
            out = torch.empty(cache_shape(block_bytes, nblocks), dtype=torch.float16)
            out.zero_()                                               # pre-touched, like a worker's staging
            await nc.request(ctl("prepare"), msgpack.packb({"block_bytes": block_bytes, "nblocks": nblocks}),
                             timeout=120)
            hand, fetch, gather, stage, cold = [], [], [], [], None
            for r in range(warmup + rounds):
                tid = f"{mode}{block_bytes}-{r}"
                verify = r == warmup                                  # check one round end to end
                t0 = time.perf_counter()
                rep = msgpack.unpackb((await nc.request(ctl("stage"), msgpack.packb(
                    {"tid": tid, "block_bytes": block_bytes, "nblocks": nblocks, "verify": verify, "mode": mode}),
                    timeout=60)).data)
                t1 = time.perf_counter()
                got = await rx.fetch(rep["handle"], out=out, timeout=60)
                t2 = time.perf_counter()
                await nc.request(ctl("release"), msgpack.packb({"tid": tid}), timeout=30)
                assert got.data_ptr() == out.data_ptr()
                if verify and zlib.crc32(got.view(-1).view(torch.uint8).numpy()) != rep["crc"]:
                    raise RuntimeError(f"{transport}: received bytes differ from the sender's")
                if r == 0:
                    cold = t2 - t0
                if r >= warmup:
                    hand.append(t2 - t0)
                    fetch.append(t2 - t1)
                    gather.append(rep["gather_s"])
                    stage.append(rep["stage_s"])
            rows.append({"transport": transport, "mode": mode, "block": block_bytes, "hand": statistics.median(hand),
                         "fetch": statistics.median(fetch), "gather": statistics.median(gather),
                         "stage": statistics.median(stage), "cold": cold})
            log.info("%s %s %d KiB done", transport, mode, block_bytes // 1024)
    finally:
        try:
            await nc.request(ctl("stop"), b"", timeout=10)
        except Exception as exc:  # noqa: BLE001
            log.warning("stopping sender: %r", exc)
        await rx.close()
        await nc.close()
        if spawn_sender:
            proc.join(timeout=15)
        if spawn_sender and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    return rows


def memcpy_baselines(total: int, rounds: int) -> dict[str, float]:
    """Seconds (median) to copy ``total`` bytes once in this process."""
    src = torch.randn(total // 2).half()
    dst = torch.empty_like(src).zero_()
    a, b = src.numpy(), dst.numpy()

    def med(fn) -> float:
        fn()
        ts = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    cache = torch.randn(cache_shape(MIB, 2 * total // MIB)).half()
    ids = torch.randperm(cache.shape[0])[: total // MIB]
    return {"torch copy_": med(lambda: dst.copy_(src)), "numpy copyto": med(lambda: np.copyto(b, a)),
            "gather kv_cache[ids] (1 MiB blocks)": med(lambda: cache[ids])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default=",".join(available_transports()))
    ap.add_argument("--blocks-kib", default="256,1024,2048")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stream-chunk-kib", type=int, default=1024)
    ap.add_argument("--stream-inflight", type=int, default=4)
    ap.add_argument("--nixl-poll-ms", type=float, default=0.5, help="NIXL progress/poll interval")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)                                          # same for every path, sender and receiver
    total = args.mib * MIB
    blocks = [int(k) * 1024 for k in args.blocks_kib.split(",")]
    base = memcpy_baselines(total, args.rounds)
    server = start_embedded_server()
    rows = []
    try:
        for name in [t for t in args.transports.split(",") if t]:
            opts = {"max_staged_bytes": 4 * total}
            if name == "stream":
                opts.update(chunk_bytes=args.stream_chunk_kib * 1024, max_inflight=args.stream_inflight)
            if name == "nixl":
                opts.update(poll_interval=args.nixl_poll_ms / 1e3)
            rows += asyncio.run(run_transport(server.url, name, blocks, total, args.rounds, args.warmup, opts))
    finally:
        server.stop()
    ref = total / base["torch copy_"] / 1e9
    print(f"\nKV transfer, {args.mib} MiB fp16 per hand-off, sender and receiver in separate processes, "
          f"1 torch thread each, {os.cpu_count()} CPUs; medians of {args.rounds} rounds after {args.warmup} warm-up")
    print("total = sender's cache blocks -> receiver's preallocated buffer: "
          "[gather +] stage + handle over NATS + fetch")
    hdr = f"{'path':<34}{'block':>7}{'total ms':>10}{'GB/s':>7}{'vs copy':>9}{'gather ms':>11}{'stage ms':>10}" \
          f"{'fetch ms':>10}{'fetch GB/s':>12}{'cold ms':>9}"
    print(hdr)
    print("-" * len(hdr))
    for label, sec in base.items():
        print(f"{label:<34}{'-':>7}{sec * 1e3:10.2f}{total / sec / 1e9:7.2f}{total / sec / 1e9 / ref:9.2f}")
    for r in rows:
        gbs = total / r["hand"] / 1e9
        label = f"{r['transport']} " + ("stage_blocks" if r["mode"] == "blocks" else "gather+stage")
        print(f"{label:<34}{r['block'] // 1024:>5}Ki{r['hand'] * 1e3:10.2f}{gbs:7.2f}{gbs / ref:9.2f}"
              f"{r['gather'] * 1e3:11.2f}{r['stage'] * 1e3:10.2f}{r['fetch'] * 1e3:10.2f}"
              f"{total / r['fetch'] / 1e9:12.2f}{r['cold'] * 1e3:9.1f}")


if __name__ == "__main__":
    main()
