"""The online P:D planner, live: a workload that turns prefill-heavy, with and without the planner.

Starts a real cluster of switchable workers (nats-server, router, ``worker-0`` prefill, ``worker-1`` and
``worker-2`` decode; SmolLM2-135M, one thread each; remote prefill for every request), sends a chat phase
(short prompts, long answers) and then a long-input phase (``--long-prompts`` prompts of ``--prompt-tokens``
tokens, ``--long-new-tokens`` answers, arriving ``--gap-s`` apart: one prefill worker cannot keep up). Run twice
side by side: planner on (it switches a decode worker to prefill when the prefill queue's predicted TTFT passes its
SLO) and off. Prints per run and phase TTFT p50/p99, TPOT p99, the planner's decisions, and checks both runs
streamed the same tokens.

    python -m benchmarks.planner_shift [--chat 8] [--long-prompts 24] [--prompt-tokens 768] [--gap-s 0.5] [--plot p.png]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

from benchmarks import plots
from benchmarks.migration_skew import pct
from benchmarks.tier_ttft import long_prompt
from shared import progress, protocol, subjects
from shared.bus import connect
from shared.client import generate_stream
from cli.launcher import Cluster, ClusterSpec


async def stream(nc, prompt: list[int], rid: str, new_tokens: int) -> dict:
    req = protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=new_tokens,
                                   temperature=0.0, ignore_eos=True, timeout_s=1800, prefill_mode="remote")
    t0, sent = time.perf_counter(), time.monotonic()
    times, tokens = [], []
    async for chunk in generate_stream(nc, req):
        if chunk.token_ids:
            times.append(time.perf_counter())
        tokens += chunk.token_ids
    return {"tokens": tokens, "ttft_s": times[0] - t0, "tpot_s": (times[-1] - times[0]) / max(1, len(times) - 1),
            "sent": sent}


def summary(results: list[dict]) -> dict:
    ttfts, tpots = [r["ttft_s"] for r in results], [r["tpot_s"] for r in results]
    return {"ttft_p50_s": round(pct(ttfts, 0.5), 2), "ttft_p99_s": round(pct(ttfts, 0.99), 2),
            "tpot_p99_ms": round(pct(tpots, 0.99) * 1000, 1)}


async def run(args, planner: bool) -> dict:
    env = {"DEEPINFER_PLANNER_TTFT_SLO_S": str(args.ttft_slo_s), "DEEPINFER_PLANNER_SUSTAIN": "2",
           "DEEPINFER_PLANNER_TPOT_SLO_S": str(args.tpot_slo_s),
           "DEEPINFER_PLANNER_COOLDOWN_S": "10"}
    cluster = Cluster(ClusterSpec(prefill=1, decode=2, kv_cache_mb=args.kv_cache_mb, cache_tier=0, http_port=-1,
                                  metrics=False, transports="shm,stream", local_prefill_threshold=0,
                                  switchable=True, planner=planner, extra_env=env))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "planner-shift")
        try:
            base = long_prompt(args.prompt_tokens + args.long_prompts + args.chat + 64)
            chat = [base[i:i + 48] for i in range(args.chat)]
            t0, t0_mono = time.perf_counter(), time.monotonic()   # the router's decisions carry monotonic times
            chat_res = await asyncio.gather(*(stream(nc, p, f"chat-{planner}-{i}", args.chat_new_tokens)
                                              for i, p in enumerate(chat)))
            tasks = []
            for i in range(args.long_prompts):
                prompt = base[64 + i:64 + i + args.prompt_tokens]  # distinct prefixes: no prefix-cache hits
                tasks.append(asyncio.create_task(stream(nc, prompt, f"long-{planner}-{i}", args.long_new_tokens)))
                await asyncio.sleep(args.gap_s)
            long_res = await progress.gather(tasks, f"long prompts (planner {'on' if planner else 'off'})")
            makespan = time.perf_counter() - t0
            reply = await nc.request(subjects.stats(cluster.router_name),
                                     protocol.encode(protocol.StatsRequest()), timeout=5)
            plan = (protocol.decode(reply.data, protocol.StatsReply).stats.get("planner") or {})
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return {"planner": planner, "makespan_s": round(makespan, 1), "chat": summary(chat_res),
            "long_input": summary(long_res), "decisions": plan.get("decisions", {}),
            "switched": [a["worker_id"] + "->" + a["role"] for a in plan.get("recent", [])],
            "tokens": [r["tokens"] for r in chat_res + long_res],
            "_ttft": [(r["sent"] - t0_mono, r["ttft_s"]) for r in chat_res + long_res],
            "_decided_s": [a["at"] - t0_mono for a in plan.get("recent", [])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chat", type=int, default=8)
    ap.add_argument("--chat-new-tokens", type=int, default=64)
    ap.add_argument("--long-prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--long-new-tokens", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--ttft-slo-s", type=float, default=2.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.5, help="the planner's (a CPU's decode step is slow)")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    ap.add_argument("--plot", default="", metavar="PNG",
                    help="also draw each request's TTFT by its send time, both runs, decisions marked (matplotlib)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    off, on = asyncio.run(run(args, False)), asyncio.run(run(args, True))
    if on.pop("tokens") != off.pop("tokens"):
        raise RuntimeError("the planner's run streamed other tokens than the fixed split's")
    print(f"chat ({args.chat} x 48-token prompts, {args.chat_new_tokens} new) then long input "
          f"({args.long_prompts} x {args.prompt_tokens} tokens every {args.gap_s} s, {args.long_new_tokens} new); "
          f"1 prefill : 2 decode switchable workers, TTFT SLO {args.ttft_slo_s} s:")
    for r in (off, on):
        c, li = r["chat"], r["long_input"]
        print(f"  planner {'on ' if r['planner'] else 'off'}: makespan {r['makespan_s']:6.1f} s | chat TTFT p99 "
              f"{c['ttft_p99_s']:.2f} s TPOT p99 {c['tpot_p99_ms']:.0f} ms | long input TTFT p50/p99 "
              f"{li['ttft_p50_s']:.2f}/{li['ttft_p99_s']:.2f} s | decisions {r['decisions'] or '{}'} {r['switched']}")
    print(f"  long-input TTFT p99 with / without the planner: "
          f"{off['long_input']['ttft_p99_s'] / max(1e-9, on['long_input']['ttft_p99_s']):.2f}x lower")
    print(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in (off, on)]))
    if args.plot:
        plots.plot_or_exit(lambda: draw(off, on, args))


def draw(off: dict, on: dict, args) -> None:
    """TTFT of every request by the time it was sent (the planner's decisions marked) and the long phase's TTFT
    CDF, planner off vs on."""
    plt, fig, (by_time, dist) = plots.panels(2, f"chat then {args.long_prompts} x {args.prompt_tokens}-token "
                                             f"prompts every {args.gap_s} s: the P:D planner off vs on")
    runs = {"planner off": off, "planner on": on}
    plots.over_time(by_time, {k: tuple(zip(*sorted(r["_ttft"]))) for k, r in runs.items()}, "TTFT (s)",
                    marks={k: r["_decided_s"] for k, r in runs.items()})
    by_time.axhline(args.ttft_slo_s, color="grey", linestyle="--")
    plots.cdf(dist, {k: [ttft for _, ttft in sorted(r["_ttft"])[args.chat:]] for k, r in runs.items()},
              "long-input TTFT (s)", slo=args.ttft_slo_s)
    plots.save(plt, fig, args.plot)


if __name__ == "__main__":
    main()
