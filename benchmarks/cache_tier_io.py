"""The cache tier's SSD write/read GB/s (``TieredBlockStore``) against a plain sequential file on the same disk.

Blocks are shaped like SmolLM2-135M's KV blocks: float32 [30 layers, 2 (K, V), 16 tokens, 3 kv heads, 64]
= 737,280 bytes (``--block-kb`` replaces the shape by a flat float32 block of that size). The payloads are
distinct slices of one seeded random pool, so each block can be regenerated to check what is read back.
GB/s = payload bytes / seconds (GB = 1e9); ratio = store / plain file. Only the I/O calls are timed (the
caller building ``StoredBlock``s, and checking the bytes read, is not). Each number is the median of
``--repeat`` rounds; the side that goes first alternates by round, and ``os.sync()`` precedes each side.

- write, fsync ``batch`` (and ``never``: page-cache speed, noisy on a VM): ``--total-mb`` of blocks through
  ``put_many``, ``--batch`` per call, into a fresh store with ``dram_bytes=0`` (write-through: every put goes
  to SSD), timed to the end of ``flush()``; the store's counters must show every block acknowledged.
  Baseline: the same payloads ``write``n to one file (unbuffered ``open(path, "wb")``), one ``os.fsync`` per
  batch under ``batch`` (the store's policy: one fsync per ``put_many``), none under ``never``.
- read cold: the page cache of the segment files is dropped (``fsync`` + ``POSIX_FADV_DONTNEED``), the store
  is reopened (DRAM empty, ``dram_bytes=0`` so nothing is promoted; the index rebuild time at open,
  ``stats()["ssd_rebuild_s"]``, is reported), the cache dropped again (the rebuild reads the newest segment's
  bodies), then every block is ``get`` in write order. Baseline: the batch file, cache dropped, read
  sequentially in chunks of one block. On a virtual disk the host may still cache: "cold" is cold-ish.
- read warm: the same again without dropping the cache.
Every block read back, from the store and from the file, must equal its payload: else ``RuntimeError``.

    python -m benchmarks.cache_tier_io [--total-mb 1024] [--batch 32] [--repeat 3] [--block-kb N] [--dir D]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cache_tier.store import DTYPE_SIZES, StoreConfig, StoredBlock, TieredBlockStore

LAYERS, KV_HEADS, BLOCK_TOKENS, HEAD_DIM = 30, 3, 16, 64      # SmolLM2-135M, block size 16
DTYPE = "float32"
MODEL_SHAPE = (LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)   # [L, 2, bs, kvh, D]
RETENTION = "chat"
STRIDE = 4093                  # prime: block i's payload starts at i * STRIDE mod block_bytes in the pool
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Workload:
    shape: tuple[int, ...]
    num_blocks: int
    batch: int
    pool: bytes                # 2 * block_bytes random bytes
    hashes: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[DTYPE]

    def payload(self, i: int) -> bytes:
        start = i * STRIDE % self.block_bytes
        return self.pool[start:start + self.block_bytes]

    def block(self, i: int) -> StoredBlock:
        tokens = [(i * BLOCK_TOKENS + t) % 49152 for t in range(BLOCK_TOKENS)]
        return StoredBlock(self.hashes[i], tokens, DTYPE, self.shape, self.payload(i))

    def batches(self) -> list[range]:
        return [range(s, min(s + self.batch, self.num_blocks)) for s in range(0, self.num_blocks, self.batch)]


def make_workload(total_mb: float, batch: int, block_kb: int | None, seed: int) -> Workload:
    shape = MODEL_SHAPE if block_kb is None else (block_kb * 1024 // DTYPE_SIZES[DTYPE],)
    block_bytes = math.prod(shape) * DTYPE_SIZES[DTYPE]
    num_blocks = max(1, int(total_mb * MIB) // block_bytes)
    rng = random.Random(seed)
    hashes = set()
    while len(hashes) < num_blocks:
        hashes.add(rng.getrandbits(64))
    return Workload(shape, num_blocks, batch, rng.randbytes(2 * block_bytes), tuple(sorted(hashes)))


def filesystem(path: Path) -> str:
    """``"<type> on <device> (<mount point>)"`` of the mount holding ``path``, from /proc/mounts."""
    path, best = path.resolve(), ("", "unknown", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, fstype = line.split()[:3]
        if path.is_relative_to(mount) and len(mount) >= len(best[0]):
            best = (mount, fstype, device)
    return f"{best[1]} on {best[2]} ({best[0] or '?'})"


def drop_cache(paths: Iterable[Path]) -> None:
    """Make the files' pages clean, then ask the kernel to drop them from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def store_write(w: Workload, directory: Path, fsync: str) -> float:
    elapsed = 0.0
    async with await TieredBlockStore.open(StoreConfig(str(directory), dram_bytes=0, fsync=fsync)) as store:
        for batch in w.batches():
            blocks = [w.block(i) for i in batch]
            t0 = time.perf_counter()
            await store.put_many(blocks, RETENTION)
            elapsed += time.perf_counter() - t0
        t0 = time.perf_counter()
        await store.flush()
        elapsed += time.perf_counter() - t0
        stats = store.stats()
    if stats["writebacks"] != w.num_blocks or stats["writeback_failures"]:   # put_many logs, never raises
        raise RuntimeError(f"store acknowledged {stats['writebacks']}/{w.num_blocks} blocks, "
                           f"{stats['writeback_failures']} failed")
    return elapsed


def plain_write(w: Workload, path: Path, fsync: str) -> float:
    elapsed = 0.0
    with open(path, "wb", buffering=0) as f:
        for batch in w.batches():
            payloads = [w.payload(i) for i in batch]
            t0 = time.perf_counter()
            for payload in payloads:
                f.write(payload)
            if fsync != "never":
                os.fsync(f.fileno())
            elapsed += time.perf_counter() - t0
    return elapsed


async def store_read(w: Workload, directory: Path, cold: bool, rebuild_s: list[float]) -> float:
    """Seconds to get every block; the index rebuild seconds at open are appended to ``rebuild_s``."""
    if cold:
        drop_cache(directory.glob("seg-*.log"))
    elapsed = 0.0
    async with await TieredBlockStore.open(StoreConfig(str(directory), dram_bytes=0)) as store:
        rebuild_s.append(store.stats()["ssd_rebuild_s"])
        if cold:
            drop_cache(directory.glob("seg-*.log"))
        for i in range(w.num_blocks):
            want = w.block(i)
            t0 = time.perf_counter()
            got = await store.get(want.block_hash, want.token_ids, RETENTION)
            elapsed += time.perf_counter() - t0
            if got is None or got != want:
                raise RuntimeError(f"store {directory}: block {i} read back differs from what was written")
        hits = store.stats()["ssd_hits"]
    if hits != w.num_blocks:
        raise RuntimeError(f"expected {w.num_blocks} SSD hits, got {hits}")
    return elapsed


def plain_read(w: Workload, path: Path, cold: bool) -> float:
    if cold:
        drop_cache([path])
    elapsed = 0.0
    with open(path, "rb", buffering=0) as f:
        for i in range(w.num_blocks):
            t0 = time.perf_counter()
            data = f.read(w.block_bytes)
            elapsed += time.perf_counter() - t0
            if data != w.payload(i):
                raise RuntimeError(f"file {path}: block {i} read back differs from what was written")
    return elapsed


def run(args: argparse.Namespace) -> dict:
    w = make_workload(args.total_mb, args.batch, args.block_kb, args.seed)
    total = w.num_blocks * w.block_bytes
    root = Path(tempfile.mkdtemp(prefix="cache_tier_io-", dir=args.dir))
    result: dict = {"dir": str(root), "filesystem": filesystem(root), "block_bytes": w.block_bytes,
                    "shape": list(w.shape), "num_blocks": w.num_blocks, "batch": w.batch, "total_bytes": total,
                    "repeat": args.repeat}
    rebuild: dict[bool, list[float]] = {True: [], False: []}

    def pair(op: str, store_fn: Callable[[], float], plain_fn: Callable[[], float],
             cleanup: Callable[[bool], None] = lambda last: None) -> None:
        """Median seconds per side over ``--repeat`` rounds; which side goes first alternates by round."""
        times: tuple[list[float], list[float]] = ([], [])
        for r in range(args.repeat):
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                os.sync()          # no dirty pages of one side throttle the other's writes
                times[side].append((store_fn, plain_fn)[side]())
            cleanup(r == args.repeat - 1)
        store, plain = (total / statistics.median(t) / 1e9 for t in times)
        result[op] = {"store_gbps": round(store, 3), "plain_gbps": round(plain, 3), "ratio": round(store / plain, 3)}

    try:
        for fsync in ("never", "batch"):       # "batch" last: its last round's files are the ones read back
            store_dir, plain = root / f"store-{fsync}", root / f"plain-{fsync}.bin"

            def cleanup(last: bool) -> None:
                if not (last and fsync == "batch"):
                    shutil.rmtree(store_dir)
                    plain.unlink()
            pair(f"write fsync={fsync}", lambda: asyncio.run(store_write(w, store_dir, fsync)),
                 lambda: plain_write(w, plain, fsync), cleanup)
        for cold in (True, False):
            pair("read cold (fadvise)" if cold else "read warm (page cache)",
                 lambda: asyncio.run(store_read(w, root / "store-batch", cold, rebuild[cold])),
                 lambda: plain_read(w, root / "plain-batch.bin", cold))
            result["rebuild_cold_s" if cold else "rebuild_warm_s"] = round(statistics.median(rebuild[cold]), 4)
        result["verified_blocks"] = 2 * args.repeat * w.num_blocks
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total-mb", type=float, default=1024.0, help="bytes of blocks written (MiB)")
    p.add_argument("--batch", type=int, default=32, help="blocks per put_many (and per fsync of the baseline)")
    p.add_argument("--block-kb", type=int, default=None, help="flat float32 blocks of this size (KiB) "
                   "instead of SmolLM2-135M's [30, 2, 16, 3, 64]")
    p.add_argument("--dir", default=None, help="parent of the scratch directory (default: the temp dir)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per measurement (median reported)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.total_mb <= 0 or args.batch < 1 or args.repeat < 1 or (args.block_kb is not None and args.block_kb < 1):
        p.error("--total-mb, --batch, --repeat and --block-kb must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = run(parse_args(argv))
    print(f"cache tier SSD I/O: {result['num_blocks']} blocks x {result['block_bytes']:,} B "
          f"(float32 {result['shape']}) = {result['total_bytes'] / MIB:.1f} MiB, {result['batch']} per batch, "
          f"median of {result['repeat']} rounds, in {result['dir']} ({result['filesystem']})")
    print(f"{'op':<24}| {'store GB/s':>10} | {'plain file GB/s':>15} | {'ratio':>6}")
    for op, row in result.items():
        if isinstance(row, dict):
            print(f"{op:<24}| {row['store_gbps']:>10.3f} | {row['plain_gbps']:>15.3f} | {row['ratio']:>6.2f}")
    print(f"index rebuild at open: cold {result['rebuild_cold_s'] * 1e3:.1f} ms, "
          f"warm {result['rebuild_warm_s'] * 1e3:.1f} ms; {result['verified_blocks']} blocks read back identical")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
