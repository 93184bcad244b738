"""The router's OpenAI HTTP API vs its NATS API on the same cluster and the same prompts (all submitted at
once, streamed, greedy, EOS ignored). Passes alternate NATS, HTTP, NATS, HTTP; each pass runs under its own
cache salt so no pass reuses another's prefix cache. Prints output tokens/s and TTFT p50 per API, the
HTTP/NATS throughput ratio and the TTFT the HTTP hop adds.

    python -m benchmarks.http_vs_nats --limit 16 --new-tokens 32 [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path

import aiohttp

from shared import protocol
from shared.bus import connect
from benchmarks.e2e_services import nats_pass
from shared.http_client import stream_events
from cli.launcher import Cluster, ClusterSpec

PROMPTS = Path(__file__).parent / "data" / "engine_prompts.json"
logger = logging.getLogger("bench.http_vs_nats")


async def salted_nats_pass(nc, prompts, new_tokens, salt) -> tuple[float, list[float], int]:
    requests = [protocol.GenerateRequest(prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                         timeout_s=1800, cache_salt=salt) for p in prompts]
    return await nats_pass(nc, requests)


async def http_pass(base, prompts, new_tokens, salt) -> tuple[float, list[float], int]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(p):
            body = {"prompt": p, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True}, "cache_salt": salt, "timeout_s": 1800}
            first, n = None, 0
            async for event in stream_events(session, base + "/v1/completions", body):
                if event["choices"] and first is None:
                    first = time.perf_counter() - t0
                if event.get("usage"):
                    n = event["usage"]["completion_tokens"]
            return first, n

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, [r[0] for r in results], sum(r[1] for r in results)


async def run(prompts, new_tokens, rounds) -> dict[str, list[tuple[float, list[float], int]]]:
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, kv_cache_mb=512, cache_tier=0, metrics=False))
    await cluster.start()
    out: dict[str, list] = {"nats": [], "http": []}
    try:
        nc = await connect(cluster.nats_url, "bench")
        await salted_nats_pass(nc, prompts[:2], 4, "warm-up")  # first-call costs (kernels, tokenizer) out of the way
        for r in range(rounds):
            out["nats"].append(await salted_nats_pass(nc, prompts, new_tokens, f"nats-{r}"))
            out["http"].append(await http_pass(cluster.http_url, prompts, new_tokens, f"http-{r}"))
        await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = [p["token_ids"] for p in json.loads(PROMPTS.read_text())["prompts"][:args.limit]]
    results = asyncio.run(run(prompts, args.new_tokens, args.rounds))
    summary = {}
    for api, passes in results.items():
        tps = [n / wall for wall, _, n in passes]
        ttft = statistics.median(t for _, ttfts, _ in passes for t in ttfts)
        summary[api] = (statistics.mean(tps), ttft)
        logger.info("%-4s  out tok/s %s (mean %.1f)  TTFT p50 %.0f ms", api, " ".join(f"{t:.1f}" for t in tps),
                    summary[api][0], ttft * 1000)
    ratio = summary["http"][0] / summary["nats"][0]
    logger.info("http/nats throughput %.3fx  added TTFT p50 %+.0f ms  (%d prompts x %d tokens, %d rounds)",
                ratio, (summary["http"][1] - summary["nats"][1]) * 1000, len(prompts), args.new_tokens, args.rounds)


if __name__ == "__main__":
    main()
