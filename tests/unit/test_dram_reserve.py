"""The cache tier's DRAM reservation (services/cache_tier/store/dram_reserve.py): after it, storing block payloads does not
page-fault; without it, every page of every new payload faults. Each case runs in a fresh interpreter (the
allocator settings are process-wide and a used heap would blur the count)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.cache_tier.store import dram_reserve

PROBE = r"""
import json, resource, sys
from services.cache_tier.store.dram_reserve import reserve_heap
reserve = int(sys.argv[1])
done = reserve_heap(reserve)
block, count = 737280, 64                     # SmolLM2's KV block (float32), 45 MiB of payloads kept
src = bytes(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
kept = [bytearray(src) for _ in range(count)]  # a copy each, as the tier stores a put's blocks
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"reserved": done.reserved, "faults": faults, "pages": block * count // 4096}))
"""


def probe(reserve_bytes: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(reserve_bytes)], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(dram_reserve._glibc() is None, reason="glibc malloc only (elsewhere reserve_heap is a no-op)")
def test_reserved_heap_stores_payloads_without_page_faults():
    cold = probe(0)
    warm = probe(128 << 20)
    assert cold["reserved"] == 0 and warm["reserved"] >= 128 << 20
    assert cold["faults"] > cold["pages"] // 2          # unreserved: (nearly) every payload page faults
    assert warm["faults"] < warm["pages"] // 20         # reserved: the payloads reuse backed heap


def test_nothing_to_reserve_is_a_no_op():
    done = dram_reserve.reserve_heap(0)
    assert done.reserved == 0 and done.seconds == 0.0
