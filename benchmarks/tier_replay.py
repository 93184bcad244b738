"""A trace window replayed live twice, side by side: the same cluster without and with the cache tier.

Each run starts a fresh cluster (nats-server, router, 1 prefill + 1 decode worker, SmolLM2-135M; plus one cache
tier in the second run) with a small device KV pool (``--kv-cache-mb``), so blocks a later request reuses are
often evicted from the workers before then: without the tier they are recomputed, with it they are pulled.
The window is replayed as ``deepinfer bench`` does (lengths ÷ ``--scale``, arrivals ÷ ``--speed``, every request
of class ``chat``). Prints hit rate (cached / prompt tokens, and the part the tier supplied), TTFT p50/p99 and
the ratios with / without.

    python -m benchmarks.tier_replay [--offset 3750 --limit 40 --speed 0.05 --kv-cache-mb 96]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging

from cli.replay import metrics_from_replay, replay, scaled_requests
from cli.traces import resolve_trace
from shared.bus import connect
from cli.launcher import Cluster, ClusterSpec
from simulator.simulate import load_trace


async def one_run(reqs, args, tier: int) -> dict:
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, kv_cache_mb=args.kv_cache_mb, cache_tier=tier,
                                  local_prefill_threshold=64))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "tier-replay")
        try:
            results = await replay(nc, reqs, timeout_s=args.timeout, retention="chat")
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    m = metrics_from_replay(results, None, None, label="tier" if tier else "no tier")
    prompt = sum(r["prompt_tokens"] for r in results if not r["error"])
    m["tier_hit_rate_tokens"] = round(sum(r["tier_cached_tokens"] for r in results) / max(1, prompt), 6)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--offset", type=int, default=3750)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--speed", type=float, default=0.05)
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument("--kv-cache-mb", type=int, default=96)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    trace = load_trace(resolve_trace(args.trace), limit=args.limit, speed=args.speed, offset=args.offset)
    reqs = scaled_requests(trace, scale=args.scale)
    runs = [asyncio.run(one_run(reqs, args, tier)) for tier in (0, 1)]
    print(f"trace window {args.offset}..{args.offset + len(reqs) - 1} (speed {args.speed}, lengths / {args.scale}), "
          f"device KV {args.kv_cache_mb} MiB per worker")
    keys = ("hit_rate_tokens", "tier_hit_rate_tokens", "ttft_p50_s", "ttft_p99_s", "errors")
    print(f"{'':10s}" + "".join(f"{k:>22s}" for k in keys))
    for m in runs:
        print(f"{m['policy']:10s}" + "".join(f"{m.get(k) if m.get(k) is not None else '-':>22}" for k in keys))
    without, with_tier = runs
    ratios = {"hit_rate": round(with_tier["hit_rate_tokens"] / max(1e-9, without["hit_rate_tokens"]), 3),
              "ttft_p50": round(with_tier["ttft_p50_s"] / without["ttft_p50_s"], 3),
              "ttft_p99": round(with_tier["ttft_p99_s"] / without["ttft_p99_s"], 3)}
    print(f"with / without tier: hit rate {ratios['hit_rate']}x, TTFT p50 {ratios['ttft_p50']}x, "
          f"p99 {ratios['ttft_p99']}x")
    print(json.dumps({"without": {k: without.get(k) for k in keys}, "with": {k: with_tier.get(k) for k in keys},
                      "ratios": ratios}))


if __name__ == "__main__":
    main()
