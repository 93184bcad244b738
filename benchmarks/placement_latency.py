"""Placement decision latency per policy with 64 workers and ~1M indexed (hash, worker) KV blocks.

The index holds prefix-shared chains: 128 "system prompts" of 16 blocks, each followed by conversations of
48 more blocks; every conversation is cached on 2 of the 64 workers (so the shared system prompts are on
many workers), and the cache tier holds every system prompt. Requests (hashes computed beforehand, as the
router does before placing) are a seeded mix: 50% continue a cached conversation, 25% start a new one on a
cached system prompt, 25% share nothing. One decision = ``index.overlap`` + ``index.tier_overlap`` +
building the ``ClusterView`` from 64 ``WorkerView`` load entries (from a pool of load reports) +
``policy.place``. Reported: p50/p99 microseconds per decision, and of it the overlap lookups alone.

    python -m benchmarks.placement_latency [--decisions 2000] [--entries 1000000]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.kv.block_hash import hash_prompt_blocks
from shared.protocol import KVEvent
from services.router.policy.kv_index import KVIndex
from services.router.policy.policies import POLICIES, make_policy
from services.router.policy.types import ClusterView, RequestInfo, WorkerView

BLOCK, WORKERS, FAMILIES, PREFIX_BLOCKS, CONV_BLOCKS, REPLICAS = 16, 64, 128, 16, 48, 2
MODEL = "0123456789abcdef0123456789abcdef"  # a model fingerprint (shared/model/fingerprint.py)


def tokens(family: int, conv: int | None, blocks: int, tail: int = 0) -> list[int]:
    """System prompt ``family`` then conversation ``conv`` (None: prefix only), plus ``tail`` new tokens."""
    out = [(family * 7919 + i) % 32000 for i in range(PREFIX_BLOCKS * BLOCK)]
    if conv is not None:
        out += [(conv * 104729 + i * 31) % 32000 for i in range(blocks * BLOCK)]
    return out + [(i * 17 + 3) % 32000 for i in range(tail)]


def build_index(target_entries: int, rng: random.Random) -> tuple[KVIndex, list[tuple[int, int]]]:
    index = KVIndex(max_blocks=2 * target_entries)  # no eviction during the build
    seq = {f"w{i}": 0 for i in range(WORKERS)}
    prefixes = [hash_prompt_blocks(tokens(f, None, 0), BLOCK, MODEL) for f in range(FAMILIES)]
    index.resync("cache-tier", 0, {"cache_tier": [h for p in prefixes for h in p]})
    cache_entries = index.stats()["entries"]
    convs: list[tuple[int, int]] = []
    while index.stats()["entries"] - cache_entries < target_entries:  # worker entries only
        family, conv = rng.randrange(FAMILIES), len(convs)
        hashes = hash_prompt_blocks(tokens(family, conv, CONV_BLOCKS), BLOCK, MODEL)
        for w in rng.sample(sorted(seq), REPLICAS):
            seq[w] += 1
            index.apply(KVEvent(worker_id=w, seq=seq[w], kind="stored", block_hashes=hashes))
        convs.append((family, conv))
    return index, convs


def make_requests(n: int, convs: list[tuple[int, int]], rng: random.Random) -> list[RequestInfo]:
    reqs = []
    for i in range(n):
        r = rng.random()
        if r < 0.5:    # next turn of a cached conversation
            family, conv = rng.choice(convs)
            toks = tokens(family, conv, CONV_BLOCKS, tail=rng.randrange(16, 400))
        elif r < 0.75:  # new conversation on a cached system prompt
            toks = tokens(rng.randrange(FAMILIES), 10**7 + i, rng.randrange(4, 40))
        else:           # nothing cached
            toks = [rng.randrange(32000) for _ in range(rng.randrange(64, 1500))]
        reqs.append(RequestInfo(f"r{i}", len(toks), tuple(hash_prompt_blocks(toks, BLOCK, MODEL)), 256))
    return reqs


def load_tables(n: int, rng: random.Random) -> list[tuple[WorkerView, ...]]:
    return [tuple(WorkerView(f"w{i}", "both", num_running=rng.randrange(0, 64), num_waiting=rng.randrange(0, 8),
                             queued_prefill_tokens=rng.randrange(0, 8192), num_free_blocks=rng.randrange(0, 20000),
                             num_total_blocks=20000, block_size=BLOCK) for i in range(WORKERS))
            for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--entries", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    index, convs = build_index(args.entries, rng)
    requests = make_requests(args.decisions, convs, rng)
    loads = load_tables(32, rng)
    stats = index.stats()
    hit = sum(1 for r in requests if index.overlap(r.block_hashes)) / len(requests)
    rows = []
    for name in POLICIES:
        policy = make_policy(name)
        total, lookup = [], []
        for i, req in enumerate(requests):
            t0 = time.perf_counter_ns()
            overlap = index.overlap(req.block_hashes)
            remote = index.tier_overlap(req.block_hashes, "cache_tier")
            t1 = time.perf_counter_ns()
            policy.place(req, ClusterView(prefill=loads[i % len(loads)], decode=(), overlap=overlap,
                                          remote_overlap=remote))
            t2 = time.perf_counter_ns()
            total.append((t2 - t0) / 1e3)
            lookup.append((t1 - t0) / 1e3)
        rows.append((name, pct(total, 0.5), pct(total, 0.99), pct(lookup, 0.5), pct(lookup, 0.99)))
    cache = FAMILIES * PREFIX_BLOCKS
    print(f"placement latency: {WORKERS} workers, {stats['entries'] - cache:,} (hash, worker) device entries "
          f"+ {cache:,} cache-tier, {len(requests)} decisions per policy, {hit:.0%} with a device prefix hit")
    print(f"{'policy':<14}{'p50 us':>10}{'p99 us':>10}{'overlap p50':>13}{'overlap p99':>13}")
    for name, p50, p99, l50, l99 in rows:
        print(f"{name:<14}{p50:>10.1f}{p99:>10.1f}{l50:>13.1f}{l99:>13.1f}")


if __name__ == "__main__":
    main()
