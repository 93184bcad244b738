"""Block store crash safety: SIGKILL a process writing blocks, reopen: every acknowledged block is readable and
intact, nothing torn is served, a torn tail is cut off."""
import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from shared.kv.block_hash import hash_prompt_blocks
from services.cache_tier.store import FakeClock, StoreConfig, StoredBlock, TieredBlockStore
from services.cache_tier.store.record import PREFIX_BYTES

REPO = Path(__file__).resolve().parents[2]
BS, PAYLOAD, MIN_ACKS = 16, 96 << 10, 60

# The writer: batches of 4 blocks of prompt i, acknowledged (printed) only after flush() returned.
WRITER = textwrap.dedent("""
    import asyncio, random, sys
    from shared.kv.block_hash import hash_prompt_blocks
    from services.cache_tier.store import FakeClock, StoreConfig, StoredBlock, TieredBlockStore

    def blocks(i):
        tokens = [i * 1000 + t for t in range(4 * 16)]
        return [StoredBlock(h, tokens[k * 16:(k + 1) * 16], "bfloat16", [2, 16, 3 * 512],
                            random.Random(h).randbytes(96 << 10))
                for k, h in enumerate(hash_prompt_blocks(tokens, 16, "m", "tenant"))]

    async def main(directory):
        cfg = StoreConfig(directory=directory, dram_bytes=6 * (100 << 10), ssd_bytes=256 << 20,
                          segment_bytes=2 << 20, max_block_bytes=1 << 20)
        store = await TieredBlockStore.open(cfg, FakeClock())
        i = 0
        while True:
            await store.put_many(blocks(i), "chat")
            await store.flush()
            print(i, flush=True)
            i += 1

    asyncio.run(main(sys.argv[1]))
""")


def blocks(i: int) -> list[StoredBlock]:
    tokens = [i * 1000 + t for t in range(4 * BS)]
    return [StoredBlock(h, tokens[k * BS:(k + 1) * BS], "bfloat16", [2, 16, 3 * 512],
                        random.Random(h).randbytes(PAYLOAD))
            for k, h in enumerate(hash_prompt_blocks(tokens, BS, "m", "tenant"))]


def test_sigkill_mid_write_loses_only_unacknowledged_blocks(tmp_path):
    directory = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    acked = []
    deadline = time.monotonic() + 120
    try:
        while len(acked) < MIN_ACKS and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked.append(int(line))
        os.kill(proc.pid, signal.SIGKILL)                # mid-write: the writer never pauses
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        stderr = proc.stderr.read()
        proc.stderr.close()
    assert len(acked) >= MIN_ACKS, stderr
    assert proc.returncode == -signal.SIGKILL

    # Whatever SIGKILL left, also tear the newest segment explicitly: half a record's header and body.
    newest = sorted(directory.glob("seg-*.log"))[-1]
    with open(newest, "ab") as f:
        f.write(newest.read_bytes()[:PREFIX_BYTES + 1000] if newest.stat().st_size else b"\x01" * 1000)
    asyncio.run(_check(directory, acked))


async def _check(directory: Path, acked: list[int]) -> None:
    cfg = StoreConfig(directory=str(directory), dram_bytes=0, ssd_bytes=256 << 20, segment_bytes=2 << 20,
                      max_block_bytes=1 << 20)
    async with await TieredBlockStore.open(cfg, FakeClock()) as store:
        s = store.stats()
        assert s["ssd_truncated_bytes"] >= 1000 and s["ssd_checksum_failures"] == 0
        for i in acked:                                   # every acknowledged block, intact
            for b in blocks(i):
                assert await store.get(b.block_hash, b.token_ids, "chat") == b
        held = [b for i in range(acked[-1] + 3) for b in blocks(i) if store.where(b.block_hash)]
        for b in held:                                    # anything else indexed is intact too
            assert await store.get(b.block_hash, b.token_ids, "chat") == b
        assert store.stats()["ssd_checksum_failures"] == 0
    async with await TieredBlockStore.open(cfg, FakeClock()) as store:
        assert store.stats()["ssd_truncated_bytes"] == 0  # the tail was cut for good
