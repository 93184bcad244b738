"""Chaos: the cache tier is restart-safe. A real tier process (``--dram-mb 0``: write-through, so an ``Ack``
means the blocks are fsynced on SSD) takes a continuous stream of puts from concurrent clients through the
``stream`` KV transport; it is SIGKILLed at a random moment while puts are in flight, restarted on the same
directory, and read back through the transport.

Asserts, after every restart: every acknowledged block is served byte-identical; every block ever sent but
not acknowledged is either absent or byte-identical (a torn block is never served); a SIGKILL leaves no
checksum failures (at most a torn tail, cut off at open) and the tier keeps taking puts and gets. A variant
flips one payload byte of two stored records (a sealed segment's, caught on read; the last record's, caught at
open when it is in the newest segment) and leaves half a record (a torn write) at the end of the newest segment,
in place of whatever the SIGKILL tore there, between the kill and the restart: those blocks are misses, each
counted once in ``ssd_checksum_failures``, exactly the torn tail is cut, every other block is still served exactly.

Payloads are re-derived from ``(SEED, put_id, k)``, so nothing is kept in memory but ids.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from nats import errors as nats_errors

from shared import protocol, subjects
from shared.errors import DeepinferError
from services.cache_tier.store.record import PREFIX_BYTES, RecordHeader, scan_segment
from shared.kv.transport_stream import StreamTransport
from tests.chaos.tier_process import TierProcess, store_stats
from tests.integration.conftest import connect, start_nats_server

SEED = 20_250_611
TIER = "cache-0"
BS = 4                              # tokens per block
WRITERS = 3                         # concurrent put clients
BLOCKS_PER_PUT = (2, 4)
BLOCK_BYTES = (64 << 10, 1 << 20)   # payload bytes of one block (uint8 [size])
ACKS_PER_ROUND = (6, 14)            # the kill comes after this many acks in the round (+ a random delay)
SEGMENT_MB, SSD_MB = 8, 256         # worst case (14 + 3 puts) x 3 rounds x 4 MiB < the 248 MiB write budget
WAIT_S = 30.0                       # bound of every wait (start-up, acks)
FLAGS = ["--dram-mb", "0", "--ssd-mb", str(SSD_MB), "--segment-mb", str(SEGMENT_MB), "--fsync", "batch",
         "--transports", "stream", "--heartbeat-s", "0.5"]       # write-through: an ack means fsynced on SSD


def put_layout(put_id: int) -> tuple[list[int], list[int], int]:
    """(block hashes, token ids, bytes per block) of put ``put_id``."""
    rng = random.Random(SEED * 1_000_003 + put_id)
    n, size = rng.randint(*BLOCKS_PER_PUT), rng.randrange(*BLOCK_BYTES)
    hashes = [int.from_bytes(hashlib.blake2b(f"{SEED}/{put_id}/{k}".encode(), digest_size=8).digest(), "little")
              for k in range(n)]
    return hashes, [put_id * 64 + i for i in range(n * BS)], size


def block_payload(put_id: int, k: int, size: int) -> np.ndarray:
    return np.random.default_rng([SEED, put_id, k]).integers(0, 256, size, dtype=np.uint8)   # [size]


@dataclasses.dataclass
class Ledger:
    """What the clients did: puts sent (their ids), puts acknowledged, errors while the tier was up."""
    issued: list[int] = dataclasses.field(default_factory=list)
    acked: set[int] = dataclasses.field(default_factory=set)
    acked_at: dict[int, float] = dataclasses.field(default_factory=dict)   # put id -> monotonic time of its Ack
    errors: list[str] = dataclasses.field(default_factory=list)
    inflight: int = 0
    inflight_at_kills: list[int] = dataclasses.field(default_factory=list)
    stopped: bool = False
    ids: itertools.count = dataclasses.field(default_factory=itertools.count)


async def put(nc, sender: StreamTransport, put_id: int, ledger: Ledger) -> None:
    hashes, token_ids, size = put_layout(put_id)
    kv = torch.from_numpy(np.stack([block_payload(put_id, k, size) for k in range(len(hashes))]))  # [n, size]
    tid = f"p-{put_id}"
    handle = await sender.stage(kv, tid)
    try:
        msg = protocol.CachePut(transfer_id=tid, worker_id="client-0", retention="chat", block_hashes=hashes,
                                token_ids=token_ids, block_size=BS, dtype="uint8", block_shape=[size],
                                transport="stream", handle=handle)
        ledger.issued.append(put_id)
        ledger.inflight += 1
        try:
            reply = await nc.request(subjects.cache_put(TIER, msg.worker_id), protocol.encode(msg), timeout=10)
        finally:
            ledger.inflight -= 1
        protocol.decode_reply(reply.data, protocol.Ack)
        ledger.acked.add(put_id)
        ledger.acked_at[put_id] = time.monotonic()
    finally:
        await sender.release(tid)


async def writer(nc, sender: StreamTransport, ledger: Ledger, pace_s: float = 0.0) -> None:
    """Put one put after another (``pace_s`` apart) until ``ledger.stopped`` (set at the kill); errors before it
    are recorded."""
    while not ledger.stopped:
        put_id = next(ledger.ids)
        try:
            await put(nc, sender, put_id, ledger)
        except (DeepinferError, nats_errors.Error, asyncio.TimeoutError) as err:
            if not ledger.stopped:
                ledger.errors.append(f"put {put_id}: {err!r}")
            await asyncio.sleep(0.05)
        if pace_s:
            await asyncio.sleep(pace_s)


async def write_then_kill(nc, tier: TierProcess, ledger: Ledger, rng: random.Random, round_no: int) -> None:
    """``WRITERS`` clients put continuously; after a random number of acks (and a random delay), with at
    least one put in flight, SIGKILL the tier; then stop the clients."""
    sender = StreamTransport(nc, f"client-{round_no}")
    ledger.stopped = False
    acked_before, target = len(ledger.acked), rng.randint(*ACKS_PER_ROUND)
    tasks = [asyncio.create_task(writer(nc, sender, ledger)) for _ in range(WRITERS)]
    try:
        deadline = time.monotonic() + WAIT_S
        while len(ledger.acked) - acked_before < target or ledger.inflight == 0:
            assert time.monotonic() < deadline, f"round {round_no}: {len(ledger.acked) - acked_before} acks " \
                                                f"in {WAIT_S:.0f} s; errors {ledger.errors[-3:]}"
            assert not ledger.errors, f"puts failed while the tier was up: {ledger.errors[:3]}"
            await asyncio.sleep(0.005)
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        ledger.inflight_at_kills.append(ledger.inflight)
        tier.kill()
        assert not ledger.errors, f"puts failed while the tier was up: {ledger.errors[:3]}"
    finally:
        ledger.stopped = True
        for task in tasks:      # nats-py may turn a cancelled request into an error: the flag ends the loop
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=WAIT_S)
        await sender.close()
    assert not pending, "writers did not stop"


async def get_block(nc, receiver: StreamTransport, tid: str, put_id: int, k: int) -> np.ndarray | None:
    """Block ``k`` of put ``put_id`` as the tier serves it (fetched through the transport), or None."""
    hashes, token_ids, size = put_layout(put_id)
    msg = protocol.CacheGet(transfer_id=tid, worker_id="client-0", retention="chat", block_hashes=[hashes[k]],
                            token_ids=token_ids[k * BS:(k + 1) * BS], block_size=BS, dtype="uint8",
                            block_shape=[size], transports=["stream"])
    reply = await nc.request(subjects.cache("get", TIER), protocol.encode(msg), timeout=10)
    got = protocol.decode_reply(reply.data, protocol.CacheGetReply)
    if got.num_blocks == 0:
        return None
    try:
        data = await receiver.fetch(got.handle, timeout=10)         # [1, size] uint8
    finally:
        await nc.publish(subjects.cache("release", TIER), protocol.encode(protocol.CacheRelease(transfer_id=tid)))
    assert got.num_blocks == 1 and tuple(data.shape) == (1, size), (got, data.shape)
    return data[0].numpy()


async def check_served(nc, ledger: Ledger, tag: str, missing_ok: set[tuple[int, int]] = frozenset()) \
        -> set[tuple[int, int]]:
    """Get every block ever sent, one by one: acknowledged ones (but ``missing_ok``) must be served, and
    whatever is served must be byte-identical. Returns the (put_id, k) served."""
    receiver = StreamTransport(nc, f"reader-{tag}")
    served, wrong, lost = set(), [], []
    try:
        for put_id in sorted(ledger.issued):
            hashes, _, size = put_layout(put_id)
            for k in range(len(hashes)):
                data = await get_block(nc, receiver, f"g-{tag}-{put_id}-{k}", put_id, k)
                if data is None:
                    if put_id in ledger.acked and (put_id, k) not in missing_ok:
                        lost.append((put_id, k))
                    continue
                served.add((put_id, k))
                if not np.array_equal(data, block_payload(put_id, k, size)):
                    wrong.append((put_id, k, "acked" if put_id in ledger.acked else "unacked"))
    finally:
        await receiver.close()
    assert not wrong, f"{tag}: blocks served with other bytes than written: {wrong}"
    assert not lost, f"{tag}: acknowledged blocks not served: {lost}"
    return served


@pytest.fixture
def nats_url():
    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.timeout(150)
async def test_sigkill_mid_write_serves_every_acked_block_and_no_torn_one(nats_url, tmp_path):
    rng, ledger = random.Random(SEED), Ledger()
    tier = TierProcess(nats_url, TIER, tmp_path / "tier", tmp_path, FLAGS, WAIT_S)
    nc = await connect(nats_url)
    opened: list[dict] = []
    try:
        await tier.start(nc)
        for round_no in range(3):
            await write_then_kill(nc, tier, ledger, rng, round_no)
            opened.append(await tier.start(nc))
            await check_served(nc, ledger, f"r{round_no}")
        after = await store_stats(nc, TIER)
    finally:
        await nc.close()
        code = tier.stop()
    print(f"\ntier crash: {len(ledger.issued)} puts sent, {len(ledger.acked)} acked, in flight at the kills "
          f"{ledger.inflight_at_kills}, torn bytes cut at each open "
          f"{[s['ssd_truncated_bytes'] for s in opened]}, segments {after['ssd_segments']}")
    assert sum(ledger.inflight_at_kills) >= 3, "every kill came with puts in flight"
    assert [s["ssd_checksum_failures"] for s in opened] == [0, 0, 0], "a SIGKILL only tears the tail"
    assert after["ssd_checksum_failures"] == 0 and after["ssd_evictions"] == 0, after
    assert code == 0, f"the restarted tier did not stop cleanly: {code}\n{tier.log_tail()}"
    assert not tier.log_problems(), tier.log_problems()


def stored_records(directory: Path) -> list[tuple[Path, int, RecordHeader]]:
    """(segment, offset, header) of every whole block record, oldest first."""
    out = []
    for path in sorted(directory.glob("seg-*.log")):
        with open(path, "rb") as f:
            scan = scan_segment(f, path.stat().st_size, True, SEGMENT_MB << 20)
        out += [(path, offset, h) for offset, h in scan.records if h.payload_len]
    return out


def damage(directory: Path, ledger: Ledger) -> tuple[dict[tuple[int, int], str], int, int, bool]:
    """Flip one payload byte of the first acknowledged block (oldest segment: sealed, caught on read) and of the
    last whole record (caught at open if it is in the newest segment, on read otherwise), then leave a torn
    write at the end of the newest segment: the first half of that record, written where the store writes its
    next record (right after the last whole record). Whatever the SIGKILL itself left there (a short write of
    the record being appended: ``write(2)`` stops at a fatal signal) is replaced, not appended to: the store
    never writes past a torn record (the process that tore it is dead; the next open cuts it before any
    append), and bytes after one could complete it, so a scan would take the pair for a whole record with a
    bad crc and cut less than was appended. Returns {(put_id, k): segment}, the torn bytes, the bytes the
    SIGKILL had torn, and whether the last record is in the newest segment."""
    where = {h: (put_id, k) for put_id in ledger.issued for k, h in enumerate(put_layout(put_id)[0])}
    records = [r for r in stored_records(directory) if r[2].block_hash in where]
    first = next(r for r in records if where[r[2].block_hash][0] in ledger.acked)
    last = records[-1]
    assert first[0] != last[0], "the writes filled more than one segment"
    newest = sorted(directory.glob("seg-*.log"))[-1]
    size = newest.stat().st_size
    with open(newest, "rb") as f:
        valid_end = scan_segment(f, size, True, SEGMENT_MB << 20).valid_end
    assert newest == last[0] or valid_end == 0, "only the newest segment holds records after the last one"
    torn = last[0].read_bytes()[last[1]:last[1] + last[2].length // 2]
    corrupted = {}
    for path, offset, header in (first, last):
        at = offset + PREFIX_BYTES + header.meta_len + header.payload_len // 2
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x40]))
        corrupted[where[header.block_hash]] = path.name
    with open(newest, "r+b") as f:
        f.truncate(valid_end)
        f.seek(valid_end)
        f.write(torn)
    return corrupted, len(torn), size - valid_end, newest == last[0]


@pytest.mark.timeout(120)
async def test_corrupt_byte_and_torn_tail_between_kill_and_restart(nats_url, tmp_path):
    rng, ledger = random.Random(SEED + 1), Ledger()
    directory = tmp_path / "tier"
    tier = TierProcess(nats_url, TIER, directory, tmp_path, FLAGS, WAIT_S)
    nc = await connect(nats_url)
    try:
        await tier.start(nc)
        await write_then_kill(nc, tier, ledger, rng, 0)
        corrupted, torn, kill_torn, last_in_newest = damage(directory, ledger)
        opened = await tier.start(nc)
        served = await check_served(nc, ledger, "corrupt", missing_ok=set(corrupted))
        again = await check_served(nc, ledger, "again", missing_ok=set(corrupted))
        put_id = max(ledger.issued) + 1                      # still takes and serves puts
        sender = StreamTransport(nc, "client-late")
        try:
            await put(nc, sender, put_id, ledger)
        finally:
            await sender.close()
        late = await check_served(nc, Ledger(issued=[put_id], acked={put_id}), "late")
        after = await store_stats(nc, TIER)
    finally:
        await nc.close()
        tier.stop()
    print(f"\ntier corruption: corrupted {corrupted}; {len(ledger.acked)} of {len(ledger.issued)} puts acked; "
          f"checksum failures at open {opened['ssd_checksum_failures']}, after the gets "
          f"{after['ssd_checksum_failures']}; torn by the SIGKILL {kill_torn}, torn write left {torn}, "
          f"cut {opened['ssd_truncated_bytes']}")
    assert not set(corrupted) & (served | again), "a corrupted block was served"
    assert opened["ssd_truncated_bytes"] == torn, opened             # exactly the torn tail, nothing more
    assert opened["ssd_checksum_failures"] == int(last_in_newest), opened   # newest segment: caught at open
    assert after["ssd_checksum_failures"] == 2, after                 # each corrupt record counted once
    assert len(late) == len(put_layout(put_id)[0])
    assert not tier.log_problems(), tier.log_problems()
