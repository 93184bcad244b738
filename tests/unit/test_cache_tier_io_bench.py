"""Smoke test of ``benchmarks/cache_tier_io.py``: it runs at tiny sizes, every block reads back identical, and
a corrupt byte makes it fail loudly. No timing assertions (speed is the benchmark's printed ratio)."""
from __future__ import annotations

import json

import pytest

from benchmarks.cache_tier_io import main, make_workload, plain_read, plain_write, store_read, store_write

OPS = ("write fsync=never", "write fsync=batch", "read cold (fadvise)", "read warm (page cache)")


def test_runs_at_tiny_size_and_reads_back_every_block(tmp_path, capsys):
    result = main(["--total-mb", "8", "--batch", "4", "--repeat", "2", "--dir", str(tmp_path)])

    assert result["block_bytes"] == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert result["num_blocks"] == (8 << 20) // 737_280 == 11
    assert result["verified_blocks"] == 2 * 2 * 11      # store + file, per round
    for op in OPS:
        assert result[op]["store_gbps"] > 0 and result[op]["plain_gbps"] > 0 and result[op]["ratio"] > 0
    assert result["rebuild_cold_s"] > 0 and result["rebuild_warm_s"] > 0
    assert result["filesystem"] != "unknown on ? (?)"
    assert list(tmp_path.iterdir()) == []                 # the scratch directory is removed
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result


def test_flat_block_size_option(tmp_path):
    result = main(["--total-mb", "1", "--block-kb", "64", "--repeat", "1", "--dir", str(tmp_path)])
    assert (result["block_bytes"], result["shape"], result["num_blocks"]) == (65_536, [16_384], 16)


async def test_a_corrupt_byte_fails_loudly(tmp_path):
    w = make_workload(total_mb=1, batch=4, block_kb=64, seed=1)
    store_dir, plain = tmp_path / "store", tmp_path / "plain.bin"
    await store_write(w, store_dir, "batch")
    plain_write(w, plain, "batch")
    for path in [*store_dir.glob("seg-*.log"), plain]:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)

    with pytest.raises(RuntimeError, match="read back differs"):
        await store_read(w, store_dir, cold=True, rebuild_s=[])
    with pytest.raises(RuntimeError, match="read back differs"):
        plain_read(w, plain, cold=True)
