"""The pause a client sees when its stream moves to another decode worker: live migration vs today's failover.

Starts a real cluster (nats-server, router, two decode processes and, with ``--mode remote``, a prefill
process; SmolLM2-135M) and, for each context length, streams a greedy request (engine benchmark prompts
concatenated, a cache salt of its own per case: every prefill is cold) three times: undisturbed, then, once
``--after`` tokens arrived, either

- **migrate**: orders a live migration (``di.v1.ctl.<router>.migrate``): the KV moves, decoding goes on; or
- **failover**: SIGTERMs the stream's decode worker with no drain grace and migration on drain off, so it hands
  the stream back and the router re-places it: prompt + delivered tokens prefilled again, by the other decode
  worker (``--mode local``, the aggregated layout ``deepinfer up`` runs) or by the prefill worker (``--mode
  remote``: its prefix cache still holds the prompt, so only the delivered tokens are computed, and the KV is
  handed to the other decode worker). The worker is respawned.

Prints, per context: the median gap between chunks before the switch (TPOT), the longest gap after it (the
pause), and the cold prefill of the context (the undisturbed request's TTFT: what a re-prefill costs without
a prefix cache); checks that the migrated and failed-over tokens equal the undisturbed run's.

    python -m benchmarks.migration_pause [--contexts 1024,4096,8000] [--mode local|remote] [--transports shm,stream]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time

from benchmarks.tier_ttft import long_prompt
from shared import protocol, subjects
from shared.bus import connect
from shared.client import generate_stream
from cli.launcher import Cluster, ClusterSpec

DECODERS = ("decode-0", "decode-1")


async def holder(nc, work_id: str) -> str:
    """The decode worker that holds ``work_id`` now."""
    for wid in DECODERS:
        reply = await nc.request(subjects.ctl(wid, "probe"), protocol.encode(protocol.RequestProbe(
            request_id=work_id)), timeout=5)
        if protocol.decode(reply.data, protocol.Ack).ok:
            return wid
    raise RuntimeError(f"no decode worker holds {work_id}")


async def one(cluster: Cluster, nc, prompt: list[int], rid: str, action: str, args) -> dict:
    """Stream ``prompt``; after ``args.after`` tokens apply ``action`` (none, migrate, failover)."""
    req = protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=args.new_tokens,
                                   temperature=0.0, ignore_eos=True, timeout_s=900, prefill_mode=args.mode,
                                   cache_salt=rid)  # its own salt: no case finds another's KV in a prefix cache
    t0 = time.perf_counter()
    times, tokens, usage, acted, victim, ordered = [], [], {}, None, None, None
    async for chunk in generate_stream(nc, req):
        if chunk.token_ids:
            times.append(time.perf_counter())
        tokens += chunk.token_ids
        usage = chunk.usage or usage
        if acted is None and len(tokens) >= args.after and action != "none":
            acted = len(times)
            if action == "migrate":  # in the background: the stream is read on meanwhile
                order = protocol.MigrateRequest(request_id=rid)
                ordered = asyncio.create_task(nc.request(subjects.ctl(cluster.router_name, "migrate"),
                                                         protocol.encode(order), timeout=120))
            else:
                victim = await holder(nc, f"{rid}~0")
                cluster.procs[victim].terminate()   # drain grace 0: hands the stream back at once
    if ordered is not None:
        protocol.decode_reply((await ordered).data, protocol.Ack)
    if victim is not None:
        await asyncio.to_thread(cluster.procs[victim].wait, 60)
        cluster.spawn_worker("decode", int(victim.split("-")[1]))
        await cluster.wait_healthy([victim], 180)
    gaps = [b - a for a, b in zip(times, times[1:])]
    before = gaps[:acted - 1] if acted else gaps
    return {"tokens": tokens, "ttft_s": times[0] - t0, "tpot_s": statistics.median(before[1:] or before),
            "pause_s": max(gaps[acted - 1:]) if acted else None, "usage": usage}


async def run(args) -> list[dict]:
    env = {"DEEPINFER_MIGRATE_ON_DRAIN": "false", "DEEPINFER_DRAIN_GRACE_S": "0",  # failover: hand back at once
           "DEEPINFER_MIGRATE_KV_HIGH": "2", "DEEPINFER_MIGRATE_SKEW_MIN": "0"}      # moves by order only
    cluster = Cluster(ClusterSpec(prefill=int(args.mode == "remote"), decode=2, kv_cache_mb=args.kv_cache_mb,
                                  local_prefill_threshold=0, cache_tier=0, http_port=-1, metrics=False,
                                  transports=args.transports, log_dir=args.log_dir, extra_env=env))
    await cluster.start()
    rows = []
    try:
        nc = await connect(cluster.nats_url, "migration-pause")
        try:
            for context in args.contexts:
                prompt = long_prompt(context)
                cases = {a: await one(cluster, nc, prompt, f"pause-{context}-{a}", a, args)
                         for a in ("none", "migrate", "failover") if a in args.cases}
                if len({tuple(c["tokens"]) for c in cases.values()}) != 1:
                    raise RuntimeError(f"context {context}: migrated or failed-over tokens differ from undisturbed")
                rows.append({"context": context, **{a: {k: v for k, v in c.items() if k != "tokens"}
                                                    for a, c in cases.items()}})
                logging.warning("context %d: %s", context, json.dumps(rows[-1]))
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8000])
    ap.add_argument("--after", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    ap.add_argument("--transports", default="shm,stream")
    ap.add_argument("--mode", default="local", choices=["local", "remote"])
    ap.add_argument("--log-dir", default="", help="keep the services' logs here")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=["none", "migrate", "failover"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = asyncio.run(run(args))
    print(f"pause a client sees when its stream moves ({args.mode} prefill, transports {args.transports}):")
    print(f"{'context':>8} {'TPOT':>8} {'migration pause':>16} {'failover pause':>15} {'cold prefill':>13}  ratio")
    for r in rows if {"none", "migrate", "failover"} <= set(args.cases) else []:
        m, f = r["migrate"], r["failover"]
        print(f"{r['context']:>8} {m['tpot_s'] * 1000:6.0f}ms {m['pause_s'] * 1000:14.0f}ms "
              f"{f['pause_s'] * 1000:13.0f}ms {r['none']['ttft_s'] * 1000:11.0f}ms  "
              f"failover/migration {f['pause_s'] / m['pause_s']:.1f}x")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
