"""End-to-end: the disaggregated services (router → prefill → decode over NATS) vs the in-process engine on
the same prompts, all submitted at once. Prints output tokens/s, TTFT p50/p99 for both, and their ratios.

    python benchmarks/e2e_services.py --limit 16 --new-tokens 32 [--mode remote|local] [--transport shm] [--rounds 3]
    python benchmarks/e2e_services.py --prefill 0     # equal cores: one aggregated worker with every core
    taskset -c 0 python benchmarks/e2e_services.py --prefill 0   # 1 core vs 1 core (router and NATS share it)

With the default split (1 prefill + 1 decode worker) each engine process gets half the cores, while the
in-process engine gets them all: that figure measures the core split as much as the served path's cost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path

from shared.client import generate_stream
from cli.launcher import Cluster, ClusterSpec
from shared import protocol
from shared.bus import connect
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def nats_pass(nc, requests: list[protocol.GenerateRequest]) -> tuple[float, list[float], int]:
    """Send every request at once and stream them: ``(wall seconds, TTFT of each, output tokens)``."""
    async def one(req):
        first, n = None, 0
        async for chunk in generate_stream(nc, req):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        return first, n

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    return time.perf_counter() - t0, [r[0] for r in results], sum(r[1] for r in results)


def in_process(prompts, new_tokens) -> tuple[float, list[float], int]:
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", device="cpu"))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    ttft, n_out = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            n_out += len(out.new_token_ids)
            ttft.setdefault(out.request_id, time.perf_counter() - t0)
    return time.perf_counter() - t0, [ttft[i] for i in ids], n_out


async def through_services(prompts, new_tokens, mode, transport, prefill: int = 1,
                           cache_tier: int = 0) -> tuple[float, list[float], int]:
    cluster = Cluster(ClusterSpec(prefill=prefill, decode=1, kv_cache_mb=512, local_prefill_threshold=0,
                                  cache_tier=cache_tier, metrics=False, http_port=-1))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "bench")

        wall, ttft, n_out = await nats_pass(nc, [protocol.GenerateRequest(
            request_id=f"b{i}", prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
            timeout_s=1800, prefill_mode=mode, transport=transport if mode == "remote" else "")
            for i, p in enumerate(prompts)])
        await nc.close()
        return wall, ttft, n_out
    finally:
        await asyncio.to_thread(cluster.stop)


def report(name: str, wall: float, ttft: list[float], n: int) -> None:
    print(f"{name:28s}: {n / wall:6.1f} output tok/s  TTFT p50 {statistics.median(ttft) * 1000:7.0f} ms"
          f"  p99 {pct(ttft, 0.99) * 1000:7.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mode", default="remote", choices=["remote", "local"])
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers (0: one aggregated decode worker "
                    "with every core, prefilling locally)")
    ap.add_argument("--cache-tier", type=int, default=0, help="cache tier services (1: as `deepinfer up` runs; "
                    "workers then write every finished request's blocks back to it)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (services and engine alternate "
                    "which goes first); the median ratio is the figure, since this machine class drifts")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    prompts = [p["token_ids"] for p in json.loads(PROMPTS.read_text())["prompts"][:args.limit]]
    if args.prefill == 0:
        args.mode = "local"
    label = f"services ({args.mode}{'/' + args.transport if args.mode == 'remote' else ''})"
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.new_tokens} new tokens each, "
          f"{len(os.sched_getaffinity(0))} cores, {args.prefill} prefill + 1 decode worker, {args.cache_tier} cache "
          f"tier, {args.rounds} rounds")
    ratios, ttft_ratios = [], []
    runs = {"services": lambda: asyncio.run(through_services(prompts, args.new_tokens, args.mode, args.transport,
                                                             args.prefill, args.cache_tier)),
            "engine": lambda: in_process(prompts, args.new_tokens)}
    for r in range(args.rounds):
        order = ("services", "engine") if r % 2 == 0 else ("engine", "services")
        results = {name: runs[name]() for name in order}
        svc, eng = results["services"], results["engine"]
        print(f"round {r + 1} ({order[0]} first)")
        report("  in-process engine", *eng)
        report("  " + label, *svc)
        ratios.append(svc[2] / svc[0] / (eng[2] / eng[0]))
        ttft_ratios.append(statistics.median(svc[1]) / statistics.median(eng[1]))
        print(f"  ratio services / engine: throughput {ratios[-1]:.2f}x, TTFT p50 {ttft_ratios[-1]:.2f}x")
    print(f"median over {args.rounds} rounds: throughput {statistics.median(ratios):.2f}x "
          f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}), TTFT p50 {statistics.median(ttft_ratios):.2f}x")


if __name__ == "__main__":
    main()
