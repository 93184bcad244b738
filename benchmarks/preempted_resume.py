"""Preempted sequences resumed from the cache tier vs recomputed (SmolLM2-135M fp32, one aggregated decode worker
and a cache tier in their own processes, the plain NATS API, greedy): a batch flood on a KV pool too small for it
and an interactive trickle that preempts batch sequences. With ``--preempt-offer-mib`` > 0 a victim's
KV goes to the tier before its blocks are freed and is pulled back before it is readmitted; with 0 (the
workers' default) it is recomputed. Same cluster shape, same requests, one after the other in one run.

Prints per mode: the flood's output tokens/s, the trickle's TTFT p50/p99 during the flood, preemptions and how the
victims resumed (the worker's ``deepinfer_worker_preempted_kv_total``), and the ratio of flood throughputs.

    python -m benchmarks.preempted_resume [--flood 32] [--flood-tokens 96] [--kv-mb 96] [--trickle 8] [--context N]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.e2e_services import pct
from benchmarks.engine_throughput import load_prompt_set
from benchmarks.slo_classes import add_load_flags, flood_with_trickle
from cli.launcher import Cluster, ClusterSpec
from shared.bus import connect

logger = logging.getLogger("preempted_resume")


def worker_counters(text: str) -> dict[str, float]:
    """The decode worker's preemption figures from its ``/metrics`` text."""
    names = {"deepinfer_worker_preemptions_total": "preemptions",
             "deepinfer_worker_preempted_kv_resumed_blocks_total": "resumed_blocks"}
    out: dict[str, float] = {}
    for sample in (s for family in text_string_to_metric_families(text) for s in family.samples):
        if sample.name == "deepinfer_worker_preempted_kv_total":
            out[sample.labels["result"]] = sample.value
        elif sample.name in names:
            out[names[sample.name]] = sample.value
    return out


async def one_run(offer_mib: int, args, prompts: list[list[int]]) -> dict:
    cluster = Cluster(ClusterSpec(prefill=0, decode=1, cache_tier=1, http_port=-1, kv_cache_mb=args.kv_mb,
                                  preempt_offer_mib=offer_mib,
                                  extra_env={"DEEPINFER_MAX_NUM_SEQS": str(args.seqs)}))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "bench")
        trickle = [prompts[-1 - i] for i in range(args.trickle)]
        loaded, flooded, wall = await flood_with_trickle(
            nc, prompts, trickle, args, (args.flood_tokens // 2, args.flood_tokens * 3 // 2), "batch",
            "interactive", settle_s=2.0)
        await nc.close()
        port = next(p for name, p in cluster.metrics_ports.items() if name.startswith("decode"))
        url = f"http://127.0.0.1:{port}/metrics"
        counters = worker_counters(await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=10.0).read().decode()))
    finally:
        await asyncio.to_thread(cluster.stop)
    return {"loaded": [t for t, _, code in loaded if not code], "flood_tok_s": sum(n for _, n, _ in flooded) / wall,
            "refused": sum(1 for *_, code in [*loaded, *flooded] if code), "wall": wall, **counters}


def long_prompts(prompts: list[list[int]], tokens: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` tokens, each the bench set's prompts joined from a different start."""
    out = []
    for i in range(count):
        joined: list[int] = []
        j = i
        while len(joined) < tokens:
            joined += prompts[j % len(prompts)]
            j += 1
        out.append(joined[:tokens])
    return out


async def main_async(args) -> None:
    prompts = load_prompt_set("distinct", 64)
    if args.context:
        prompts = long_prompts(prompts, args.context, args.flood) + prompts[-args.trickle:]
    logger.info("flood: %d batch requests x ~%d tokens at once; trickle: %d interactive x %d tokens, one every "
                "%.1f s; one decode worker (%d MiB KV, max_num_seqs %d) and a cache tier", args.flood,
                args.flood_tokens, args.trickle, args.trickle_tokens, args.every, args.kv_mb, args.seqs)
    results = {}
    for name, mib in (("resume from tier", args.offer_mib), ("recompute", 0)):
        r = results[name] = await one_run(mib, args, prompts)
        logger.info("  %-16s: flood %.1f out tok/s in %.1f s; trickle TTFT p50 %5.0f ms p99 %5.0f ms; %d "
                    "preemptions (offered %d, resumed %d with %d blocks, recomputed %d); %d refused", name,
                    r["flood_tok_s"], r["wall"], statistics.median(r["loaded"]) * 1000,
                    pct(r["loaded"], 0.99) * 1000, r.get("preemptions", 0), r.get("offered", 0),
                    r.get("resumed", 0), r.get("resumed_blocks", 0), r.get("recomputed", 0), r["refused"])
    on, off = results["resume from tier"], results["recompute"]
    logger.info("flood throughput with resume from the tier: %.2fx of recompute", on["flood_tok_s"] / off["flood_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_flags(ap, flood=32, flood_tokens=96)
    ap.add_argument("--seqs", type=int, default=16, help="the decode worker's max_num_seqs")
    ap.add_argument("--kv-mb", type=int, default=96, help="the decode worker's KV pool (small: preemptions)")
    ap.add_argument("--context", type=int, default=0,
                    help="> 0: the flood's prompts are this long (the bench set's prompts joined)")
    ap.add_argument("--offer-mib", type=int, default=256, help="--preempt-offer-mib of the resume run")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
