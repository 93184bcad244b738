"""Block store (services/cache_tier/store): round trips per tier, LRU, write-back, promotion, tenant isolation,
token checks on hash collisions, the `none` class, bad input, and SSD I/O kept off the event loop."""
import asyncio
import random
import threading

import pytest

from shared.errors import DeepinferError, ErrorCode
from shared.kv.block_hash import hash_prompt_blocks
from services.cache_tier.store import FakeClock, RetentionPolicy, StoreConfig, StoredBlock, TieredBlockStore
from services.cache_tier.store.dram import DramEntry, DramTier
from shared.retention import BlockMeta

BS = 4                    # tokens per block
PAYLOAD = 256             # bytes per block: float16[128]
NBYTES = PAYLOAD + 4 * BS  # StoredBlock.nbytes


def make_blocks(n: int, seed: int = 0, salt: str = "", payload: int = PAYLOAD) -> list[StoredBlock]:
    """``n`` chained blocks of one prompt (real hashes); payload bytes are a function of the hash."""
    tokens = [seed * 100_000 + i for i in range(n * BS)]
    hashes = hash_prompt_blocks(tokens, BS, "m", salt)
    return [StoredBlock(h, tokens[i * BS:(i + 1) * BS], "float16", [payload // 2],
                        random.Random(h).randbytes(payload)) for i, h in enumerate(hashes)]


def config(tmp_path, **kw) -> StoreConfig:
    kw.setdefault("dram_bytes", 1 << 20)
    kw.setdefault("ssd_bytes", 1 << 20)
    kw.setdefault("segment_bytes", 64 << 10)
    kw.setdefault("max_block_bytes", 16 << 10)
    return StoreConfig(directory=str(tmp_path / "kv"), **kw)


@pytest.fixture
def clock():
    return FakeClock()


async def open_store(tmp_path, clock, **kw) -> TieredBlockStore:
    return await TieredBlockStore.open(config(tmp_path, **kw), clock)


def test_stored_block_validation():
    good = make_blocks(1)[0]
    assert StoredBlock(good.block_hash, list(good.token_ids), "float16", [128], bytearray(good.payload)) == good
    assert isinstance(StoredBlock(1, [1], "uint8", [2], memoryview(b"ab")).payload, bytes)
    bad = [
        dict(block_hash=True), dict(block_hash=-1), dict(block_hash=1 << 64), dict(block_hash="1"),
        dict(token_ids="abcd"), dict(token_ids=[]), dict(token_ids=[1, 2, 3, 1 << 32]), dict(token_ids=[1.0]),
        dict(token_ids=list(range(1025))), dict(dtype="float12"), dict(dtype=None), dict(shape=[0]),
        dict(shape=[-128]), dict(shape="128"), dict(shape=[]), dict(shape=[64]), dict(payload="x" * 256),
        dict(payload=b"x" * 255),
    ]
    for change in bad:
        fields = dict(block_hash=good.block_hash, token_ids=good.token_ids, dtype="float16", shape=[128],
                      payload=good.payload) | change
        with pytest.raises(DeepinferError) as err:
            StoredBlock(**fields)
        assert err.value.code == ErrorCode.INVALID_REQUEST, change


async def test_dram_round_trip(tmp_path, clock):
    async with await open_store(tmp_path, clock) as store:
        [b] = make_blocks(1)
        await store.put(b, "chat")
        assert store.where(b.block_hash) == "dram"
        assert await store.get(b.block_hash, b.token_ids, "chat") == b
        s = store.stats()
        assert (s["dram_hits"], s["ssd_hits"], s["misses"], s["ssd_blocks"]) == (1, 0, 0, 0)
        assert (s["dram_bytes"], s["dram_blocks"]) == (NBYTES, 1)


async def test_ssd_round_trip_write_through(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        blocks = make_blocks(3)
        await store.put_many(blocks, "chat")
        assert [store.where(b.block_hash) for b in blocks] == ["ssd"] * 3
        for b in blocks:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
        s = store.stats()
        assert (s["dram_hits"], s["ssd_hits"], s["promotions"], s["ssd_blocks"], s["writebacks"]) == (0, 3, 0, 3, 3)
        assert s["ssd_bytes_read"] == s["ssd_bytes_written"] == s["ssd_live_bytes"] == s["ssd_disk_bytes"] > 3 * PAYLOAD


def test_dram_tier_lru_order():
    dram = DramTier(3 * NBYTES)
    a, b, c, d = make_blocks(4)
    meta = BlockMeta("chat", 1.0, 0.0)
    for blk in (a, b, c):
        assert dram.put(DramEntry(blk, meta)) == []
    assert dram.get(a.block_hash).block == a          # a becomes most recent
    assert dram.peek(b.block_hash).block == b         # peek does not
    [evicted] = dram.put(DramEntry(d, meta))
    assert evicted.block == b
    assert dram.lru_order() == [c.block_hash, a.block_hash, d.block_hash]
    assert dram.bytes_used == 3 * NBYTES
    big = StoredBlock(7, [1], "uint8", [4 * NBYTES], bytes(4 * NBYTES))
    assert [e.block for e in dram.put(DramEntry(big, meta))] == [big]   # too big: returned, not stored
    assert dram.lru_order() == [c.block_hash, a.block_hash, d.block_hash]


async def test_write_back_on_dram_pressure_and_lru(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=3 * NBYTES) as store:
        blocks = make_blocks(6)
        await store.put_many(blocks[:3], "chat")
        await store.get(blocks[0].block_hash, blocks[0].token_ids, "chat")   # 0 is now most recent
        await store.put_many(blocks[3:5], "chat")                            # pushes out 1 then 2
        assert [store.where(b.block_hash) for b in blocks] == ["dram", "ssd", "ssd", "dram", "dram", None]
        s = store.stats()
        assert (s["dram_evictions"], s["writebacks"], s["ssd_blocks"]) == (2, 2, 2)
        for b in blocks[:5]:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b


async def test_promotion_on_ssd_hit_is_clean(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=2 * NBYTES) as store:
        a, b, c = make_blocks(3)
        await store.put_many([a, b, c], "chat")                  # a is written back
        assert store.where(a.block_hash) == "ssd"
        assert await store.get(a.block_hash, a.token_ids, "chat") == a
        assert store.where(a.block_hash) == "dram"               # promoted (b pushed out, written back)
        s = store.stats()
        assert (s["promotions"], s["ssd_hits"], s["ssd_blocks_written"]) == (1, 1, 2)
        await store.put(make_blocks(1, seed=5)[0], "chat")      # pushes c out: written back
        await store.put(make_blocks(1, seed=6)[0], "chat")      # pushes a out: clean, not rewritten
        s = store.stats()
        assert store.where(a.block_hash) == "ssd"
        assert (s["ssd_blocks_written"], s["writebacks"], s["ssd_blocks"]) == (3, 3, 3)


async def test_tenant_isolation(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=2 * NBYTES) as store:
        tenant_a, tenant_b = make_blocks(4, salt="tenant-a"), make_blocks(4, salt="tenant-b")
        assert [b.token_ids for b in tenant_a] == [b.token_ids for b in tenant_b]   # same prompt
        assert not {b.block_hash for b in tenant_a} & {b.block_hash for b in tenant_b}
        await store.put_many(tenant_a, "chat")                   # two in DRAM, two on SSD
        for b in tenant_b:
            assert store.where(b.block_hash) is None
            assert await store.get(b.block_hash, b.token_ids, "chat") is None
        for b in tenant_a:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
        assert store.stats()["misses"] == 4


@pytest.mark.parametrize("dram_bytes", [1 << 20, 0], ids=["dram", "ssd"])
async def test_token_mismatch_on_hash_collision_is_a_miss(tmp_path, clock, dram_bytes):
    async with await open_store(tmp_path, clock, dram_bytes=dram_bytes) as store:
        [b] = make_blocks(1)
        await store.put(b, "chat")
        other_tokens = [t + 1 for t in b.token_ids]
        assert await store.get(b.block_hash, other_tokens, "chat") is None
        s = store.stats()
        assert s["dram_token_mismatches" if dram_bytes else "ssd_token_mismatches"] == 1
        assert (s["misses"], s["dram_hits"], s["ssd_hits"]) == (1, 0, 0)
        assert await store.get(b.block_hash, b.token_ids, "chat") == b   # the block itself is intact


async def test_none_class_is_dram_only(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=2 * NBYTES) as store:
        a, b, c, d = make_blocks(4)
        await store.put_many([a, b], "none")
        clock.advance(30 * 86_400)                               # no time-based expiry for DRAM-only
        assert await store.get(a.block_hash, a.token_ids, "chat") == a   # a chat hit upgrades a
        await store.put_many([c, d], "none")                     # pushes out b (dropped), a (written back)
        assert (store.where(a.block_hash), store.where(b.block_hash)) == ("ssd", None)
        await store.flush()                                      # flush never writes DRAM-only blocks
        s = store.stats()
        assert (s["dropped_dram_only"], s["ssd_blocks"], s["writebacks"]) == (1, 1, 1)
    async with await open_store(tmp_path, clock, dram_bytes=2 * NBYTES) as store:
        assert [store.where(x.block_hash) for x in (a, b, c, d)] == ["ssd", None, None, None]


async def test_bad_input_gives_clear_errors(tmp_path, clock):
    store = await open_store(tmp_path, clock, max_block_bytes=1024)
    [b] = make_blocks(1)
    big = StoredBlock(1, [1], "uint8", [2048], bytes(2048))
    cases = [
        (store.put(b, "weekly"), ErrorCode.INVALID_REQUEST),
        (store.put_many([b, "not a block"], "chat"), ErrorCode.INVALID_REQUEST),
        (store.put_many(b, "chat"), ErrorCode.INVALID_REQUEST),
        (store.put_many([b, big], "chat"), ErrorCode.PAYLOAD_TOO_LARGE),
        (store.get("12", b.token_ids, "chat"), ErrorCode.INVALID_REQUEST),
        (store.get(-5, b.token_ids, "chat"), ErrorCode.INVALID_REQUEST),
        (store.get(b.block_hash, ["a"], "chat"), ErrorCode.INVALID_REQUEST),
        (store.get(b.block_hash, b.token_ids, 7), ErrorCode.INVALID_REQUEST),
    ]
    for coro, code in cases:
        with pytest.raises(DeepinferError) as err:
            await coro
        assert err.value.code == code
    assert store.where(b.block_hash) is None                     # all or nothing: b was not stored
    assert await store.get(12345, [1, 2, 3, 4], "chat") is None  # unknown hash: a miss
    await store.close()
    await store.close()                                          # idempotent
    with pytest.raises(DeepinferError) as err:
        await store.get(b.block_hash, b.token_ids, "chat")
    assert err.value.code == ErrorCode.UNAVAILABLE


def test_config_validation(tmp_path):
    for kw in [dict(dram_bytes=-1), dict(ssd_bytes=100 << 10), dict(max_block_bytes=60 << 10),
               dict(fsync="sometimes"), dict(compact_dead_ratio=0), dict(evict_low_watermark=1.5),
               dict(touch_persist_s=float("nan")), dict(retention={"chat": 1}), dict(dram_bytes=1.5)]:
        with pytest.raises(DeepinferError) as err:
            config(tmp_path, **kw)
        assert err.value.code == ErrorCode.INVALID_REQUEST, kw
    for ttl in [{"chat": -1}, {"bad name": 1}, {"x" * 17: 1}, {}, {"chat": float("inf")}, {"chat": True}]:
        with pytest.raises(DeepinferError):
            RetentionPolicy(ttl)


async def test_second_open_of_a_directory_is_refused(tmp_path, clock):
    async with await open_store(tmp_path, clock):
        with pytest.raises(DeepinferError) as err:
            await open_store(tmp_path, clock)
        assert err.value.code == ErrorCode.UNAVAILABLE


async def test_ssd_io_never_runs_on_the_event_loop(tmp_path, clock, monkeypatch):
    async with await open_store(tmp_path, clock, dram_bytes=NBYTES) as store:
        loop_thread, seen = threading.get_ident(), []
        for name in ("put_many", "get", "touch_many", "gc", "flush", "close"):
            original = getattr(store._ssd, name)

            def spy(*args, _original=original, _name=name):
                seen.append((_name, threading.get_ident()))
                return _original(*args)
            monkeypatch.setattr(store._ssd, name, spy)
        a, b = make_blocks(2)
        await store.put_many([a, b], "chat")
        assert await store.get(a.block_hash, a.token_ids, "chat") == a
        await store.gc()
        await store.flush()
    assert {n for n, _ in seen} == {"put_many", "get", "touch_many", "gc", "flush", "close"}
    assert all(ident != loop_thread for _, ident in seen)


async def test_concurrent_coroutines(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=8 * NBYTES) as store:
        prompts = [make_blocks(6, seed=s) for s in range(20)]

        async def client(blocks):
            await store.put_many(blocks, "chat")
            await asyncio.sleep(0)
            return [await store.get(b.block_hash, b.token_ids, "agent") for b in blocks]

        results = await asyncio.gather(*(client(p) for p in prompts))
        assert results == prompts
        s = store.stats()
        assert s["dram_hits"] + s["ssd_hits"] == 120 and s["misses"] == 0
        assert s["dram_blocks"] + s["ssd_blocks"] >= 120


async def test_one_put_takes_as_many_blocks_as_one_wire_put_carries(tmp_path, clock):
    """The store's batch bound is the wire's (``MAX_TIER_BLOCKS``): a 77K-token context at block size 16 is 4,812
    blocks, and a store bound of 4,096 refused its write-back after the wire took it (the tier lost the put)."""
    from shared.protocol_cache import MAX_TIER_BLOCKS
    from services.cache_tier.store.tiered import MAX_BATCH_BLOCKS

    assert MAX_BATCH_BLOCKS == MAX_TIER_BLOCKS >= 77_000 // 16
    store = await open_store(tmp_path, clock, dram_bytes=64 << 20)
    blocks = [StoredBlock(i + 1, [i], "uint8", [1], bytes([i % 256])) for i in range(5000)]
    await store.put_many(blocks, "chat")
    assert store.where(5000) is not None
    with pytest.raises(DeepinferError) as err:
        await store.put_many([StoredBlock(i + 1, [i], "uint8", [1], b"x") for i in range(MAX_TIER_BLOCKS + 1)],
                             "chat")
    assert err.value.code == ErrorCode.INVALID_REQUEST
    await store.close()
