"""Block store retention: expiry and extension with a fake clock (days in milliseconds), GC, capacity eviction
in (expiry, last use) order, segment compaction, and the SSD byte bound under churn."""
import os

import pytest

from shared.errors import DeepinferError
from services.cache_tier.store import FakeClock, RetentionPolicy, TieredBlockStore
from shared.retention import DAY_S
from tests.unit.test_block_store import config, make_blocks, open_store


@pytest.fixture
def clock():
    return FakeClock()


def disk_bytes(tmp_path) -> int:
    return sum(p.stat().st_size for p in (tmp_path / "kv").glob("seg-*.log"))


def test_policy_rules_and_spec():
    policy = RetentionPolicy()
    assert dict(policy.ttl_s) == {"chat": 7 * DAY_S, "agent": 3 * DAY_S, "none": 0.0}
    meta = policy.new_meta("agent", 100.0)
    assert (meta.retention, meta.expiry, meta.last_use) == ("agent", 100.0 + 3 * DAY_S, 100.0)
    policy.extend(meta, "none", 200.0)                 # never shortens; last use still moves
    assert (meta.retention, meta.expiry, meta.last_use) == ("agent", 100.0 + 3 * DAY_S, 200.0)
    policy.extend(meta, "chat", 300.0)
    assert (meta.retention, meta.expiry) == ("chat", 300.0 + 7 * DAY_S)
    none = policy.new_meta("none", 5.0)
    assert (none.expiry, none.is_durable, none.is_expired(1e12)) == (0.0, False, False)
    spec = RetentionPolicy.from_spec("chat=2d, agent=12h,batch=90m,none=0,raw=30")
    assert dict(spec.ttl_s) == {"chat": 2 * DAY_S, "agent": 43_200.0, "batch": 5_400.0, "none": 0.0, "raw": 30.0}
    for bad in ["chat", "chat=-1", "chat=1w", "=5", ""]:
        with pytest.raises(DeepinferError):
            RetentionPolicy.from_spec(bad)


@pytest.mark.parametrize("dram_bytes", [1 << 20, 0], ids=["dram", "ssd"])
async def test_expiry_and_extension_days_in_ms(tmp_path, clock, dram_bytes):
    async with await open_store(tmp_path, clock, dram_bytes=dram_bytes) as store:
        [chat] = make_blocks(1, seed=1)
        [agent] = make_blocks(1, seed=2)
        await store.put(chat, "chat")
        await store.put(agent, "agent")
        clock.advance(3 * DAY_S + 1)                                # agent's 3 days are over
        assert await store.get(agent.block_hash, agent.token_ids, "agent") is None
        assert await store.get(chat.block_hash, chat.token_ids, "chat") == chat   # extends to now + 7 d
        clock.advance(7 * DAY_S - 1)                                # 10 d after the put: alive by the hit
        assert await store.get(chat.block_hash, chat.token_ids, "none") == chat   # none: no extension
        clock.advance(2)
        assert await store.get(chat.block_hash, chat.token_ids, "chat") is None
        s = store.stats()
        assert s["dram_expiries" if dram_bytes else "ssd_expiries"] == 2
        assert (s["misses"], s["dram_blocks"], s["ssd_blocks"]) == (2, 0, 0)


async def test_deployment_ttls_are_configurable(tmp_path, clock):
    policy = RetentionPolicy({"chat": 60.0, "agent": 10.0, "none": 0.0})
    async with await open_store(tmp_path, clock, retention=policy, dram_bytes=0) as store:
        [b] = make_blocks(1)
        await store.put(b, "chat")                           # expires at 60
        clock.advance(55)
        assert await store.get(b.block_hash, b.token_ids, "agent") == b   # expires at max(60, 55 + 10)
        clock.advance(9)
        assert await store.get(b.block_hash, b.token_ids, "none") == b    # 64: alive
        clock.advance(2)
        assert await store.get(b.block_hash, b.token_ids, "chat") is None  # 66: gone


async def test_gc_removes_expired_blocks_from_both_tiers(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=3 * 272) as store:
        agents, chats = make_blocks(4, seed=1), make_blocks(4, seed=2)
        await store.put_many(agents, "agent")
        await store.put_many(chats, "chat")                  # 3 chats in DRAM; agents + 1 chat on SSD
        clock.advance(4 * DAY_S)
        report = await store.gc()
        assert (report.dram_expired, report.ssd_expired) == (0, 4)
        clock.advance(3 * DAY_S)
        report = await store.gc()
        assert (report.dram_expired, report.ssd_expired) == (3, 1)
        s = store.stats()
        assert (s["dram_blocks"], s["ssd_blocks"], s["ssd_live_bytes"]) == (0, 0, 0)
        assert report.segments_compacted == 1 and s["ssd_disk_bytes"] == 0 == disk_bytes(tmp_path)


async def test_capacity_eviction_order_is_expiry_then_last_use(tmp_path, clock):
    # budget = ssd_bytes - segment_bytes = 128 KiB; a block record is ~8.3 KiB: 15 fit
    store = await open_store(tmp_path, clock, dram_bytes=0, ssd_bytes=192 << 10)
    agents = make_blocks(5, seed=1, payload=8 << 10)
    chats = make_blocks(5, seed=2, payload=8 << 10)
    await store.put_many(agents, "agent")                    # equal expiry and last use within a class
    await store.put_many(chats, "chat")
    uses = [(agents[3], "none"), (agents[1], "none"), (agents[4], "none"), (agents[0], "none"),
            (agents[2], "none"), (chats[2], "none"), (chats[0], "none"), (chats[3], "chat"), (chats[4], "none"),
            (chats[1], "none")]
    for b, retention in uses:                                 # "none" moves last use only; chats[3] is extended
        clock.advance(60)
        assert await store.get(b.block_hash, b.token_ids, retention) == b
    expected = [b.block_hash for b in [agents[3], agents[1], agents[4], agents[0], agents[2], chats[2], chats[0],
                                       chats[4], chats[1], chats[3]]]
    assert store._ssd.eviction_order() == expected
    fillers = make_blocks(12, seed=3, payload=8 << 10)
    for f in fillers:
        clock.advance(1)
        await store.put(f, "chat")
        assert disk_bytes(tmp_path) <= 192 << 10
    evicted = [h for h in expected if store.where(h) is None]
    assert evicted == expected[:len(evicted)] and 0 < len(evicted) < len(expected)
    s = store.stats()
    assert s["ssd_evictions"] == len(evicted) and s["ssd_disk_bytes"] <= 128 << 10
    for b in fillers:                                          # newest blocks all survived
        assert await store.get(b.block_hash, b.token_ids, "chat") == b
    await store.close()


async def test_compaction_reclaims_bytes_and_keeps_live_blocks(tmp_path, clock):
    store = await open_store(tmp_path, clock, dram_bytes=0, ssd_bytes=1 << 20, segment_bytes=32 << 10,
                             compact_dead_ratio=0.3)
    agents = make_blocks(24, seed=1, payload=2 << 10)
    chats = make_blocks(24, seed=2, payload=2 << 10)
    for a, c in zip(agents, chats):                        # interleaved: every segment ~half dead later
        await store.put(a, "agent")
        await store.put(c, "chat")
    segments_before, disk_before = len(list((tmp_path / "kv").glob("seg-*.log"))), disk_bytes(tmp_path)
    assert segments_before >= 3
    clock.advance(3 * DAY_S + 1)
    report = await store.gc()
    assert (report.ssd_expired, report.segments_compacted) == (24, segments_before)
    s = store.stats()
    assert s["ssd_compactions"] == report.segments_compacted
    assert disk_bytes(tmp_path) == s["ssd_disk_bytes"] == s["ssd_live_bytes"] < disk_before * 0.6
    assert s["ssd_bytes_reclaimed"] == disk_before - disk_bytes(tmp_path)
    for c in chats:
        assert await store.get(c.block_hash, c.token_ids, "chat") == c
    await store.close()
    store = await TieredBlockStore.open(config(tmp_path, dram_bytes=0, segment_bytes=32 << 10), clock)
    for c in chats:                                         # and after a restart
        assert await store.get(c.block_hash, c.token_ids, "chat") == c
    for a in agents:
        assert store.where(a.block_hash) is None
    await store.close()


async def test_ssd_bound_holds_under_churn(tmp_path, clock):
    ssd_bytes = 256 << 10
    async with await open_store(tmp_path, clock, dram_bytes=4 * 4200, ssd_bytes=ssd_bytes,
                                segment_bytes=32 << 10) as store:
        prompts = [make_blocks(4, seed=s, payload=4 << 10) for s in range(40)]   # ~4x the SSD
        for i, blocks in enumerate(prompts):
            clock.advance(60)
            await store.put_many(blocks, "agent" if i % 3 else "chat")
            if i >= 5:                                       # re-use an older prompt now and then
                old = prompts[i - 5]
                await store.get(old[0].block_hash, old[0].token_ids, "chat")
            assert disk_bytes(tmp_path) <= ssd_bytes - (32 << 10)
        s = store.stats()
        assert s["ssd_evictions"] > 0 and s["ssd_compactions"] > 0 and s["ssd_checksum_failures"] == 0
        assert s["ssd_disk_bytes"] == disk_bytes(tmp_path)
        for blocks in prompts:                               # whatever is still indexed reads back intact
            for b in blocks:
                if store.where(b.block_hash) is not None:
                    assert await store.get(b.block_hash, b.token_ids, "chat") == b
        assert len(os.listdir(tmp_path / "kv")) <= 1 + ssd_bytes // (32 << 10)


async def test_extension_survives_restart(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        [b] = make_blocks(1)
        await store.put(b, "chat")                           # expires at t0 + 7 d
        clock.advance(6 * DAY_S)
        assert await store.get(b.block_hash, b.token_ids, "chat") == b   # now t0 + 13 d: a touch record
    assert store.stats()["ssd_touches_written"] == 1         # written at close
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        clock.advance(5 * DAY_S)                             # t0 + 11 d
        assert await store.get(b.block_hash, b.token_ids, "none") == b
        clock.advance(2 * DAY_S + 1)                         # t0 + 13 d + 1
        assert await store.get(b.block_hash, b.token_ids, "chat") is None
