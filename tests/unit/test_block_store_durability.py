"""Block store durability: restart rebuilds the index (timed on 10,000 records), a flipped byte is a counted
miss never served, torn tails are cut at open, a corrupt header loses only what follows it in its segment;
write-behind puts dirty durable DRAM blocks on SSD within ``write_behind_s`` (off the loop, never class none)."""
import asyncio
import threading
import time

import pytest

from services.cache_tier.config import CacheTierConfig
from shared.errors import DeepinferError, ErrorCode
from services.cache_tier.store import FakeClock, StoreConfig, TieredBlockStore
from services.cache_tier.store.record import PREFIX_BYTES
from tests.unit.test_block_store import config, make_blocks, open_store


@pytest.fixture
def clock():
    return FakeClock()


def segment_files(tmp_path):
    return sorted((tmp_path / "kv").glob("seg-*.log"))


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


async def test_restart_rebuilds_index(tmp_path, clock):
    durable, dram_only = make_blocks(8, seed=1), make_blocks(3, seed=2)
    async with await open_store(tmp_path, clock, dram_bytes=4 * 272) as store:
        await store.put_many(durable, "chat")            # 4 written back, 4 dirty in DRAM
        await store.put_many(dram_only, "none")          # pushes 3 more chat blocks to SSD
    assert store.stats()["writebacks"] == 8              # close flushed the dirty rest
    async with await open_store(tmp_path, clock, dram_bytes=4 * 272) as store:
        s = store.stats()
        assert (s["ssd_blocks"], s["ssd_rebuild_records"], s["ssd_truncated_bytes"]) == (8, 8, 0)
        for b in durable:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
        for b in dram_only:
            assert await store.get(b.block_hash, b.token_ids, "chat") is None


async def test_expired_blocks_are_dropped_at_open(tmp_path, clock):
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        await store.put_many(make_blocks(3, seed=1), "agent")
        await store.put_many(make_blocks(2, seed=2), "chat")
    clock.advance(4 * 86_400)
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        s = store.stats()
        assert (s["ssd_blocks"], s["ssd_expiries"], s["ssd_rebuild_records"]) == (2, 3, 5)


async def test_rebuild_of_10000_records_is_fast(tmp_path, clock):
    cfg = config(tmp_path, dram_bytes=0, ssd_bytes=16 << 20, segment_bytes=1 << 20)
    blocks = make_blocks(10_000, payload=64)
    async with await TieredBlockStore.open(cfg, clock) as store:
        for i in range(0, len(blocks), 500):
            await store.put_many(blocks[i:i + 500], "chat")
    started = time.perf_counter()
    store = await TieredBlockStore.open(cfg, clock)
    wall = time.perf_counter() - started
    s = store.stats()
    print(f"\nblock store rebuild: {s['ssd_rebuild_records']} records in {s['ssd_segments']} segments "
          f"({s['ssd_disk_bytes'] / 1e6:.1f} MB): index {s['ssd_rebuild_s'] * 1e3:.1f} ms, open {wall * 1e3:.1f} ms")
    assert (s["ssd_blocks"], s["ssd_rebuild_records"]) == (10_000, 10_000)
    for b in blocks[::997]:
        assert await store.get(b.block_hash, b.token_ids, "chat") == b
    await store.close()


async def test_flipped_byte_is_a_counted_miss_never_served(tmp_path, clock):
    blocks = make_blocks(3)
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        await store.put_many(blocks, "chat")
        path, offset, length = store._ssd.location(blocks[1].block_hash)
        flip_byte(path, offset + length - 100)           # inside the payload, live file
        assert await store.get(blocks[1].block_hash, blocks[1].token_ids, "chat") is None
        assert await store.get(blocks[1].block_hash, blocks[1].token_ids, "chat") is None   # dropped: no reread
        assert await store.get(blocks[2].block_hash, blocks[2].token_ids, "chat") == blocks[2]
        s = store.stats()
        assert (s["ssd_checksum_failures"], s["misses"], s["ssd_hits"], s["ssd_blocks"]) == (1, 2, 1, 2)


@pytest.mark.parametrize("newest", [True, False], ids=["newest-segment", "sealed-segment"])
async def test_flipped_byte_after_restart(tmp_path, clock, newest):
    blocks = make_blocks(3)
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        await store.put_many(blocks, "chat")
        path, offset, length = store._ssd.location(blocks[0].block_hash)
    if not newest:   # a second session seals the first segment: rebuild then checks only headers there
        async with await open_store(tmp_path, clock, dram_bytes=0) as store:
            await store.put_many(make_blocks(1, seed=9), "chat")
    flip_byte(path, offset + PREFIX_BYTES + 3)           # in the metadata (token ids)
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        assert await store.get(blocks[0].block_hash, blocks[0].token_ids, "chat") is None
        for b in blocks[1:]:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
        s = store.stats()
        assert s["ssd_checksum_failures"] == 1 and s["ssd_truncated_bytes"] == 0
        assert s["ssd_blocks"] == (2 if newest else 3)   # found at open, or at the first read


@pytest.mark.parametrize("tail", ["half-record", "garbage", "zeros"])
async def test_torn_tail_is_truncated_at_open(tmp_path, clock, tail):
    blocks, extra = make_blocks(4), make_blocks(1, seed=7)[0]
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        await store.put_many(blocks, "chat")
        await store.put(extra, "chat")
        path, offset, length = store._ssd.location(extra.block_hash)
    good_size = offset
    data = path.read_bytes()
    torn = {"half-record": data[offset:offset + length // 2], "garbage": bytes(range(256)) * 3,
            "zeros": bytes(1000)}[tail]
    path.write_bytes(data[:offset] + torn)               # as if the last write was cut short
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        s = store.stats()
        assert (s["ssd_truncated_bytes"], s["ssd_blocks"], s["ssd_checksum_failures"]) == (len(torn), 4, 0)
        assert path.stat().st_size == good_size
        assert await store.get(extra.block_hash, extra.token_ids, "chat") is None
        for b in blocks:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        assert store.stats()["ssd_truncated_bytes"] == 0


async def test_corrupt_header_in_a_sealed_segment(tmp_path, clock):
    blocks = make_blocks(6)
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        await store.put_many(blocks, "chat")
        path, offset, _ = store._ssd.location(blocks[3].block_hash)
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        await store.put(make_blocks(1, seed=9)[0], "chat")   # the first segment is now sealed
    flip_byte(path, offset + 20)                               # the hash field of record 3's header
    async with await open_store(tmp_path, clock, dram_bytes=0) as store:
        s = store.stats()
        assert s["ssd_truncated_bytes"] > 0 and path.stat().st_size == offset
        got = [await store.get(b.block_hash, b.token_ids, "chat") for b in blocks]
        assert got == blocks[:3] + [None] * 3


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_every_fsync_policy_round_trips_across_restart(tmp_path, clock, fsync):
    blocks = make_blocks(5)
    async with await open_store(tmp_path, clock, dram_bytes=2 * 272, fsync=fsync) as store:
        await store.put_many(blocks, "agent")
    async with await open_store(tmp_path, clock, dram_bytes=2 * 272, fsync=fsync) as store:
        assert [await store.get(b.block_hash, b.token_ids, "agent") for b in blocks] == blocks


async def test_a_write_through_put_whose_ssd_write_fails_is_refused(tmp_path, clock, monkeypatch):
    """With no DRAM tier a put is on SSD or refused: an SSD error is ``unavailable``, never a silent ack."""
    from shared.errors import DeepinferError, ErrorCode

    store = await open_store(tmp_path, clock, dram_bytes=0)
    try:
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(store._ssd, "put_many", disk_full)
        with pytest.raises(DeepinferError) as info:
            await store.put_many(make_blocks(2), "chat")
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert store.stats()["writeback_failures"] == 2
        monkeypatch.undo()
        await store.put_many(make_blocks(2, seed=1), "none")        # DRAM-only class: nothing to lose
        await store.put_many(make_blocks(2, seed=2), "chat")         # the disk works again
        assert store.where(make_blocks(2, seed=2)[1].block_hash) == "ssd"
    finally:
        await store.close()


# -- write-behind: a durable block acknowledged in DRAM reaches SSD within write_behind_s ----------------------
WRITE_BEHIND_S = 0.2


async def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``condition()`` until true; fail after ``timeout_s`` (a deadline, not a timing assertion)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


async def test_write_behind_reaches_ssd_without_lru_pressure_and_never_writes_none(tmp_path, clock, monkeypatch):
    chat, dram_only, upgraded = make_blocks(5, seed=1), make_blocks(3, seed=2), make_blocks(1, seed=3)[0]
    loop_thread, writers = threading.get_ident(), []
    store = await open_store(tmp_path, clock, write_behind_s=WRITE_BEHIND_S)      # 1 MiB of DRAM: no pressure
    original = store._ssd.put_many

    def spy(items):
        writers.append(threading.get_ident())
        return original(items)
    monkeypatch.setattr(store._ssd, "put_many", spy)
    try:
        await store.put_many(dram_only + [upgraded], "none")
        await store.put_many(chat, "chat")
        assert store.stats()["ssd_blocks"] == 0                # acknowledged in DRAM only, so far
        await wait_until(lambda: all(store._ssd.contains(b.block_hash) for b in chat), "chat blocks on SSD")
        assert await store.get(upgraded.block_hash, upgraded.token_ids, "agent") == upgraded   # now durable
        await wait_until(lambda: store._ssd.contains(upgraded.block_hash), "upgraded block on SSD")
        # the writer counts a batch once its SSD write returned: the block can be visible on SSD a moment before
        await wait_until(lambda: store.stats()["write_behind_blocks"] == 6, "the write-behind counters")
        s = store.stats()
        assert (s["dram_evictions"], s["dram_blocks"], s["ssd_blocks"]) == (0, 9, 6)
        assert (s["write_behind_blocks"], s["writebacks"], s["dropped_dram_only"]) == (6, 6, 0)
        assert not any(store._ssd.contains(b.block_hash) for b in dram_only)
        assert [store.where(b.block_hash) for b in chat + dram_only] == ["dram"] * 8   # still served from DRAM
        assert writers and loop_thread not in writers          # the SSD writes ran on the store's thread
        written = s["ssd_blocks_written"]
    finally:
        await store.close()
    assert store.stats()["ssd_blocks_written"] == written     # close had nothing dirty left to write
    async with await open_store(tmp_path, clock) as store:
        for b in chat + [upgraded]:
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
        assert [store.where(b.block_hash) for b in dram_only] == [None] * 3


async def test_write_behind_retries_after_an_ssd_failure(tmp_path, clock, monkeypatch):
    blocks = make_blocks(3)
    store = await open_store(tmp_path, clock, write_behind_s=WRITE_BEHIND_S)
    original, calls = store._ssd.put_many, []

    def fails_once(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return original(items)
    monkeypatch.setattr(store._ssd, "put_many", fails_once)
    try:
        await store.put_many(blocks, "agent")
        await wait_until(lambda: store.stats()["ssd_blocks"] == 3, "blocks on SSD after the retry")
        s = store.stats()
        assert calls == [3, 3]
        assert (s["writeback_failures"], s["write_behind_blocks"], s["dram_blocks"]) == (3, 3, 3)
    finally:
        await store.close()


def test_write_behind_config():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(DeepinferError) as err:
            StoreConfig(directory="/tmp/x", write_behind_s=bad)
        assert err.value.code == ErrorCode.INVALID_REQUEST, bad
    assert StoreConfig(directory="/tmp/x").write_behind_s is None             # the library default: off
    assert CacheTierConfig(worker_id="t", directory="/tmp/x").write_behind_s == 1.0   # the service default
    with pytest.raises(ValueError):
        CacheTierConfig(worker_id="t", directory="/tmp/x", write_behind_s=0.0)
