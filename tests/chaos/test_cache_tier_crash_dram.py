"""Chaos: with the DRAM tier on, an acknowledged chat block survives a SIGKILL once ``write_behind_s`` has passed.

A real tier process with ``--dram-mb 64`` acknowledges a put once the blocks are in DRAM; write-behind puts them
on SSD within ``--write-behind-s``. Writers put chat blocks at a pace that never fills DRAM (so no block reaches
SSD by LRU pressure: asserted from the tier's counters), the tier is SIGKILLed at a random moment with puts in
flight, restarted on the same directory and read back.

Asserts, after every restart: every block acknowledged more than ``BOUND_S + MARGIN_S`` before the kill is served
byte-identical; every other block ever sent (acknowledged later, or never) is absent or byte-identical; a SIGKILL
leaves no checksum failures. Ack times are taken by the client when the reply arrives (after the tier sent it),
so the age of an ack is never overstated. Helpers and payloads come from ``test_cache_tier_crash``.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from shared.kv.transport_stream import StreamTransport
from tests.chaos.test_cache_tier_crash import SEGMENT_MB, SSD_MB, TIER, WAIT_S, Ledger, check_served, \
    put_layout, writer
from tests.chaos.tier_process import TierProcess, store_stats
from tests.integration.conftest import connect, start_nats_server

SEED = 20_250_612
BOUND_S = 0.5                       # --write-behind-s
MARGIN_S = 0.5                      # scheduling slack of a loaded 2-core machine, on top of the bound
ROUND_S = (2.0, 3.0)                # puts run this long before the kill (then it waits for one in flight)
WRITERS = 2
PACE_S = 0.2                        # pause between one writer's puts: ≤ ~25 MB/s, far below 64 MiB per round
ROUNDS = 2
FLAGS = ["--dram-mb", "64", "--write-behind-s", str(BOUND_S), "--ssd-mb", str(SSD_MB), "--segment-mb",
         str(SEGMENT_MB), "--fsync", "batch", "--transports", "stream", "--heartbeat-s", "0.5"]


@pytest.fixture
def nats_url():
    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


async def write_then_kill(nc, tier: TierProcess, ledger: Ledger, rng: random.Random, round_no: int) \
        -> tuple[float, dict]:
    """Put for a random time, then SIGKILL the tier with a put in flight: (kill time, store counters just before)."""
    sender = StreamTransport(nc, f"client-dram-{round_no}")
    ledger.stopped = False
    tasks = [asyncio.create_task(writer(nc, sender, ledger, PACE_S)) for _ in range(WRITERS)]
    try:
        await asyncio.sleep(rng.uniform(*ROUND_S))
        before = await store_stats(nc, TIER)
        deadline = time.monotonic() + WAIT_S
        while ledger.inflight == 0:     # no await between this check and the kill
            assert time.monotonic() < deadline, f"round {round_no}: no put in flight; errors {ledger.errors[-3:]}"
            await asyncio.sleep(0.005)
        ledger.inflight_at_kills.append(ledger.inflight)
        killed_at = time.monotonic()
        tier.kill()
        assert not ledger.errors, f"puts failed while the tier was up: {ledger.errors[:3]}"
    finally:
        ledger.stopped = True
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=WAIT_S)
        await sender.close()
    assert not pending, "writers did not stop"
    return killed_at, before


@pytest.mark.timeout(150)
async def test_sigkill_with_dram_tier_serves_every_block_acked_before_the_bound(nats_url, tmp_path):
    rng, ledger = random.Random(SEED), Ledger()
    tier = TierProcess(nats_url, TIER, tmp_path / "tier", tmp_path, FLAGS, WAIT_S)
    nc = await connect(nats_url)
    recent: set[tuple[int, int]] = set()       # acked within the bound before a kill: may be lost
    old_blocks, counts, opened, befores = 0, [], [], []
    try:
        await tier.start(nc)
        for round_no in range(ROUNDS):
            acked_before = set(ledger.acked)
            killed_at, before = await write_then_kill(nc, tier, ledger, rng, round_no)
            befores.append(before)
            fresh = {p for p in ledger.acked - acked_before if killed_at - ledger.acked_at[p] <= BOUND_S + MARGIN_S}
            recent |= {(p, k) for p in fresh for k in range(len(put_layout(p)[0]))}
            opened.append(await tier.start(nc))
            served = await check_served(nc, ledger, f"dram-r{round_no}", missing_ok=recent)
            acked = {(p, k) for p in ledger.acked for k in range(len(put_layout(p)[0]))}
            old_blocks = len(acked - recent)
            counts.append((len(acked), old_blocks, len(acked & served), len(acked - served)))
    finally:
        await nc.close()
        code = tier.stop()
    print(f"\ntier crash with DRAM on (write_behind_s {BOUND_S} + margin {MARGIN_S} s), per round, cumulative: "
          f"(blocks acked, acked > bound before a kill, acked blocks served after restart, acked blocks lost) "
          f"{counts}; puts in flight at the kills {ledger.inflight_at_kills}; before each kill "
          f"{[(b['write_behind_blocks'], b['writebacks'], b['dram_blocks']) for b in befores]} "
          f"(write-behind blocks, all write-backs, DRAM blocks)")
    assert all(b["writebacks"] == b["write_behind_blocks"] > 0 for b in befores), \
        "every write-back before a kill was write-behind, not LRU pressure"
    assert all(b["dram_blocks"] > 0 for b in befores), befores
    assert old_blocks > 0 and all(n >= 1 for n in ledger.inflight_at_kills), (counts, ledger.inflight_at_kills)
    assert [s["ssd_checksum_failures"] for s in opened] == [0] * ROUNDS, "a SIGKILL only tears the tail"
    assert code == 0, f"the restarted tier did not stop cleanly: {code}\n{tier.log_tail()}"
    assert not tier.log_problems(), tier.log_problems()
