"""Skewed load, live: a decode worker joins while another runs every stream. With live migration (the policy's
skew rule) the streams even out onto the newcomer; without, it idles until new requests come.

Starts a real cluster (nats-server, router, two decode processes with local prefill, SmolLM2-135M, one thread
each), takes ``decode-1`` down, sends ``--streams`` greedy requests at once (all land on ``decode-0``), brings
``decode-1`` back once every stream has its first token, and waits for all to finish. Run twice side by side:
router migration on (skew rule, the default) and off (``--migrate-skew-min 0``). Prints per run the makespan,
output tokens/s, per-stream TPOT p50/p99 and TTFT p99, the migrations made, and checks both runs streamed the
same tokens.

    python -m benchmarks.migration_skew [--streams 16] [--prompt-tokens 512] [--new-tokens 256] [--plot skew.png]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time

from benchmarks import plots
from benchmarks.tier_ttft import long_prompt
from shared import progress, protocol
from shared.bus import connect
from shared.client import generate_stream
from cli.launcher import Cluster, ClusterSpec


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def stream(nc, prompt: list[int], rid: str, new_tokens: int, first: asyncio.Event) -> dict:
    req = protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=new_tokens,
                                   temperature=0.0, ignore_eos=True, timeout_s=1800, prefill_mode="local")
    t0 = time.perf_counter()
    times, tokens, usage = [], [], {}
    async for chunk in generate_stream(nc, req):
        if chunk.token_ids:
            times.append(time.perf_counter())
            first.set()
        tokens += chunk.token_ids
        usage = chunk.usage or usage
    return {"tokens": tokens, "ttft_s": times[0] - t0, "tpot_s": (times[-1] - times[0]) / max(1, len(times) - 1),
            "migrations": usage.get("migrations", 0), "times": times}


async def run(args, migrate: bool) -> dict:
    env = {} if migrate else {"DEEPINFER_MIGRATE_SKEW_MIN": "0"}
    cluster = Cluster(ClusterSpec(prefill=0, decode=2, kv_cache_mb=args.kv_cache_mb, cache_tier=0, http_port=-1,
                                  metrics=False, transports="shm,stream", extra_env=env))
    await cluster.start()
    try:
        await cluster.terminate("decode-1")          # the newcomer, not there yet
        nc = await connect(cluster.nats_url, "migration-skew")
        try:
            base = long_prompt(args.prompt_tokens + args.streams)
            prompts = [base[i:i + args.prompt_tokens] for i in range(args.streams)]  # distinct prefixes
            firsts = [asyncio.Event() for _ in prompts]
            await asyncio.sleep(1.0)                 # its last heartbeat said draining: no work goes there
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(stream(nc, p, f"skew-{migrate}-{i}", args.new_tokens, firsts[i]))
                     for i, p in enumerate(prompts)]
            await asyncio.gather(*(f.wait() for f in firsts))
            cluster.spawn_worker("decode", 1)
            await cluster.wait_healthy(["decode-1"], 180)
            joined = time.perf_counter()
            results = await progress.gather(tasks, f"streams (migration {'on' if migrate else 'off'})")
            makespan = time.perf_counter() - t0
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    tpots, ttfts = [r["tpot_s"] for r in results], [r["ttft_s"] for r in results]
    return {"migration": migrate, "makespan_s": round(makespan, 2),
            "out_tok_s": round(sum(len(r["tokens"]) for r in results) / makespan, 1),
            "tpot_p50_ms": round(statistics.median(tpots) * 1000, 1), "tpot_p99_ms": round(pct(tpots, 0.99) * 1000, 1),
            "ttft_p99_s": round(pct(ttfts, 0.99), 2), "migrations": sum(r["migrations"] for r in results),
            "tokens": [r["tokens"] for r in results],
            "_token_times": [t - t0 for r in results for t in r["times"]], "_tpots": tpots,
            "_joined_s": joined - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    ap.add_argument("--plot", default="", metavar="PNG",
                    help="also draw tokens streamed over time and the TPOT CDF of both runs here (needs matplotlib)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    on, off = asyncio.run(run(args, True)), asyncio.run(run(args, False))
    if on.pop("tokens") != off.pop("tokens"):
        raise RuntimeError("the migrated run streamed other tokens than the unmigrated one")
    print(f"{args.streams} streams on decode-0, decode-1 joins after their first tokens "
          f"({args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each):")
    for r in (off, on):
        print(f"  migration {'on ' if r['migration'] else 'off'}: makespan {r['makespan_s']:6.1f} s, "
              f"{r['out_tok_s']:6.1f} tok/s, TPOT p50/p99 {r['tpot_p50_ms']:.0f}/{r['tpot_p99_ms']:.0f} ms, "
              f"TTFT p99 {r['ttft_p99_s']:.1f} s, {r['migrations']} migrations")
    print(f"  with / without: throughput {on['out_tok_s'] / off['out_tok_s']:.2f}x, "
          f"TPOT p99 {off['tpot_p99_ms'] / on['tpot_p99_ms']:.2f}x lower")
    print(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in (off, on)]))
    if args.plot:
        plots.plot_or_exit(lambda: draw(off, on, args))


def draw(off: dict, on: dict, args) -> None:
    """Tokens streamed by all streams over time (decode-1's joining marked) and per-stream TPOT CDFs."""
    plt, fig, (tokens, tpot) = plots.panels(2, f"{args.streams} streams on decode-0, decode-1 joins after their "
                                            f"first tokens ({args.prompt_tokens}-token prompts)")
    runs = {"migration off": off, "migration on": on}
    plots.over_time(tokens, {k: plots.cumulative(r["_token_times"]) for k, r in runs.items()}, "tokens streamed",
                    marks={k: [r["_joined_s"]] for k, r in runs.items()})
    plots.cdf(tpot, {k: [t * 1e3 for t in r["_tpots"]] for k, r in runs.items()}, "TPOT per stream (ms)")
    plots.save(plt, fig, args.plot)


if __name__ == "__main__":
    main()
