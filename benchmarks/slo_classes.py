"""SLO classes under a batch flood from one client (SmolLM2-135M fp32, one aggregated decode worker in its own
process, the plain NATS API, greedy): an interactive trickle's TTFT and the flood's throughput with classes on
(the flood sends ``slo_class: batch``, the trickle ``interactive``) vs off (both name none: today's behaviour, one
priority). Within one client the router's per-tenant fairness cannot help; only the classes can.

Per run, on a fresh cluster: the trickle's requests one after another on the idle cluster (unloaded TTFT), then
``--flood`` requests at once (the bench set's prompts, output lengths uniform in 1/4..7/4 of ``--flood-tokens``)
and, while they run, the trickle again, one every ``--every`` s. Prints the trickle's TTFT p50/p99 idle and
during the flood, the flood's output tokens/s, and how many flood requests were refused (with a code).

    python -m benchmarks.slo_classes [--flood 64] [--flood-tokens 64] [--trickle 8] [--seqs 16]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import time

from benchmarks.e2e_services import pct
from benchmarks.engine_throughput import load_prompt_set
from cli.launcher import Cluster, ClusterSpec
from shared import progress, protocol
from shared.bus import connect
from shared.client import generate_stream
from shared.errors import DeepinferError

logger = logging.getLogger("slo_classes")


async def ttft(nc, req: protocol.GenerateRequest) -> tuple[float | None, int, str]:
    """``(seconds to the first token, output tokens, error code or "")`` of one streamed request."""
    t0, first, n = time.perf_counter(), None, 0
    try:
        async for chunk in generate_stream(nc, req):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
    except DeepinferError as err:
        return first, n, err.code.value
    return first, n, ""


def req(i: int, prompt: list[int], max_tokens: int, slo_class: str) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True, prefill_mode="local", slo_class=slo_class,
                                    timeout_s=600.0)


async def flood_with_trickle(nc, prompts: list[list[int]], trickle: list[list[int]], args, lengths: tuple[int, int],
                             flood_class: str, trickle_class: str, settle_s: float):
    """``args.flood`` requests of ``prompts`` at once (output lengths uniform in ``lengths``, seeded) and, ``settle_s``
    later, ``trickle`` one every ``args.every`` s (``args.trickle_tokens`` each). Returns ``(trickle results, flood
    results, seconds from the flood's start to its end)``, each result ``ttft``'s."""
    rng = random.Random(7)
    t0 = time.perf_counter()
    flood = [asyncio.create_task(ttft(nc, req(i, prompts[i % len(prompts)], rng.randint(*lengths), flood_class)))
             for i in range(args.flood)]
    await asyncio.sleep(settle_s)
    during = []
    for i, p in enumerate(trickle):
        during.append(asyncio.create_task(ttft(nc, req(2000 + i, p, args.trickle_tokens, trickle_class))))
        await asyncio.sleep(args.every)
    loaded = await asyncio.gather(*during)
    flooded = await progress.gather(flood, "flood")
    return loaded, flooded, time.perf_counter() - t0


def add_load_flags(ap: argparse.ArgumentParser, flood: int, flood_tokens: int) -> None:
    """The flood and trickle flags both load benchmarks take."""
    ap.add_argument("--flood", type=int, default=flood)
    ap.add_argument("--flood-tokens", type=int, default=flood_tokens)
    ap.add_argument("--trickle", type=int, default=8)
    ap.add_argument("--trickle-tokens", type=int, default=8)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between trickle requests during the flood")


async def one_run(classes: bool, args, prompts: list[list[int]]) -> dict:
    flood_class, trickle_class = ("batch", "interactive") if classes else ("", "")
    cluster = Cluster(ClusterSpec(prefill=0, decode=1, cache_tier=0, metrics=False, http_port=-1,
                                  extra_env={"DEEPINFER_MAX_NUM_SEQS": str(args.seqs)}))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "bench")
        trickle = [prompts[-1 - i][:64] for i in range(args.trickle)]
        idle = [(await ttft(nc, req(1000 + i, p, args.trickle_tokens, trickle_class)))[0]
                for i, p in enumerate(trickle)]
        loaded, flooded, wall = await flood_with_trickle(
            nc, prompts, trickle, args, (args.flood_tokens // 4, args.flood_tokens * 7 // 4), flood_class,
            trickle_class, settle_s=1.0)
        await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return {"idle": [t for t in idle if t is not None], "loaded": [t for t, _, code in loaded if not code],
            "trickle_refused": sum(1 for *_, code in loaded if code),
            "flood_tok_s": sum(n for _, n, _ in flooded) / wall,
            "flood_refused": sum(1 for *_, code in flooded if code)}


async def main_async(args) -> None:
    prompts = load_prompt_set("distinct", 64)
    logger.info("flood: %d requests x ~%d tokens at once; trickle: %d requests x %d tokens, one every %.1f s; one "
                "decode worker, max_num_seqs %d", args.flood, args.flood_tokens, args.trickle, args.trickle_tokens,
                args.every, args.seqs)
    results = {}
    for name, classes in (("classes on", True), ("classes off", False)):
        r = results[name] = await one_run(classes, args, prompts)
        logger.info("  %-11s: trickle TTFT idle p50 %6.0f ms; during the flood p50 %6.0f ms, p99 %6.0f ms (%d "
                    "refused); flood %.1f out tok/s (%d refused)", name, statistics.median(r["idle"]) * 1000,
                    statistics.median(r["loaded"]) * 1000, pct(r["loaded"], 0.99) * 1000, r["trickle_refused"],
                    r["flood_tok_s"], r["flood_refused"])
    on, off = results["classes on"], results["classes off"]
    logger.info("trickle TTFT during the flood: p50 %.1fx, p99 %.1fx lower with classes; flood throughput %.2fx of "
                "classes off", statistics.median(off["loaded"]) / statistics.median(on["loaded"]),
                pct(off["loaded"], 0.99) / pct(on["loaded"], 0.99), on["flood_tok_s"] / off["flood_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_flags(ap, flood=64, flood_tokens=64)
    ap.add_argument("--seqs", type=int, default=16, help="the decode worker's max_num_seqs (the gate's window)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
