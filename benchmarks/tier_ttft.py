"""TTFT of a repeated long prompt: cold (computed) vs pulled from the cache tier after the workers restarted.

Starts a real cluster (nats-server, router, cache tier, prefill and decode processes, SmolLM2-135M), sends a
``--tokens``-token prompt (engine benchmark prompts concatenated) cold, restarts every worker (SIGTERM: they
drain and flush their write-backs; new processes have empty KV pools), sends it again: its prefix now comes
from the tier (``tier_cached_tokens``), from DRAM or, with ``--tier-restart``, from SSD after the tier restarted
too. A third send is the workers' own device-cache hit, for reference. Prints TTFT per case, the ratio cold /
tier, and checks that the greedy tokens are identical in every case.

    python -m benchmarks.tier_ttft [--tokens 2048] [--repeat 3] [--tier-restart] [--mode remote|local]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path

from shared import protocol
from shared.bus import connect
from shared.client import generate_stream
from cli.launcher import Cluster, ClusterSpec

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"


def long_prompt(tokens: int) -> list[int]:
    ids: list[int] = []
    for p in json.loads(PROMPTS.read_text())["prompts"]:
        ids += p["token_ids"]
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"the benchmark prompts hold fewer than {tokens} tokens")


async def send(url: str, prompt: list[int], mode: str, new_tokens: int,
               timeout_s: float = 600) -> tuple[float, list[int], dict]:
    nc = await connect(url, "tier-ttft")
    try:
        req = protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=new_tokens, temperature=0.0,
                                       ignore_eos=True, timeout_s=timeout_s, retention="chat", prefill_mode=mode)
        t0, ttft, tokens, usage = time.perf_counter(), None, [], {}
        async for chunk in generate_stream(nc, req):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            tokens += chunk.token_ids
            usage = chunk.usage or usage
        return ttft, tokens, usage
    finally:
        await nc.close()


async def restart(cluster: Cluster, names: list[str]) -> None:
    for name in names:
        await cluster.terminate(name)
    for name in names:
        if name.startswith("cache-"):
            cluster.spawn_tier(int(name.split("-")[1]))
        else:
            role, index = name.split("-")
            cluster.spawn_worker(role, int(index))
    await cluster.wait_healthy(names, 180)


async def run(args) -> dict:
    prompt = long_prompt(args.tokens)
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, kv_cache_mb=512, local_prefill_threshold=0,
                                  cache_tier=1, cache_tier_dram_mb=0 if args.tier_restart else 1024))
    await cluster.start()
    cases: dict[str, list[float]] = {"cold": [], "tier": [], "device": []}
    outputs, usages = set(), {}
    workers = ["prefill-0", "decode-0"]
    try:
        for r in range(args.repeat):
            salted = [prompt[0] + r + 1] + prompt[1:] if r else prompt    # a new prefix each round: cold again
            for case in ("cold", "tier", "device"):
                if case == "tier":
                    await restart(cluster, workers + (["cache-0"] if args.tier_restart else []))
                ttft, tokens, usage = await send(cluster.nats_url, salted, args.mode, args.new_tokens)
                cases[case].append(ttft)
                outputs.add((r, tuple(tokens)))
                usages[case] = usage
    finally:
        await asyncio.to_thread(cluster.stop)
    if len(outputs) != args.repeat:
        raise RuntimeError("greedy tokens differ between cold, tier and device-cache runs")
    return {"prompt_tokens": len(prompt), "mode": args.mode, "tier_restarted": args.tier_restart,
            "ttft_s": {c: round(statistics.median(v), 4) for c, v in cases.items()},
            "usage": {c: {k: u.get(k) for k in ("cached_tokens", "tier_cached_tokens")} for c, u in usages.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mode", default="remote", choices=["remote", "local"])
    ap.add_argument("--tier-restart", action="store_true",
                    help="restart the tier too (DRAM tier off): the prefix comes from its SSD files")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    res = asyncio.run(run(args))
    t = res["ttft_s"]
    src = "SSD (tier restarted)" if args.tier_restart else "tier"
    print(f"{res['prompt_tokens']}-token prompt, {args.mode} prefill, median of {args.repeat}:")
    print(f"  cold (computed)          TTFT {t['cold'] * 1000:8.0f} ms")
    print(f"  {src:<24} TTFT {t['tier'] * 1000:8.0f} ms   cold / tier = {t['cold'] / t['tier']:.1f}x")
    print(f"  device prefix cache      TTFT {t['device'] * 1000:8.0f} ms   cold / device = {t['cold'] / t['device']:.1f}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
