"""Two tenants, one flooding: the other's TTFT with the router's fair gate vs without (SmolLM2-135M fp32, one
aggregated decode worker in its own process, the NATS tenant API, greedy).

Per run, on a fresh cluster: ``calm`` first sends ``--calm`` requests one after another on an idle cluster (the
unloaded TTFT), then ``flood`` sends ``--flood`` requests at once (the bench set's prompts, output lengths drawn
uniformly from 1/4 to 7/4 of ``--flood-tokens``, as real traffic varies) and, while they run, ``calm`` sends its
requests again, one every ``--calm-every`` s, each on its own. Runs: the fair gate (dispatch window =
the worker's ``max_num_seqs``, ``--seqs``) and no gate (``dispatch_window -1``: every request goes straight to
the engine's FIFO queue, as before the gate). Prints calm TTFT p50/p99 and the flood's output tokens/s for each.

    python -m benchmarks.tenant_fairness [--flood 64] [--flood-tokens 64] [--calm 8] [--seqs 16]
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
from shared import protocol
from shared.bus import connect
from shared.client import generate_stream
from cli.launcher import Cluster, ClusterSpec


async def ttft(nc, req: protocol.GenerateRequest, tenant: str) -> tuple[float, int]:
    """``(seconds to the first token, output tokens)`` of one streamed request."""
    t0, first, n = time.perf_counter(), None, 0
    async for chunk in generate_stream(nc, req, tenant=tenant):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
        n += len(chunk.token_ids)
    return first, n


def req(i: int, prompt: list[int], max_tokens: int) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True, prefill_mode="local")


async def one_run(window: int, args, prompts: list[list[int]]) -> dict:
    cluster = Cluster(ClusterSpec(prefill=0, decode=1, cache_tier=0, metrics=False, http_port=-1,
                                  extra_env={"DEEPINFER_DISPATCH_WINDOW": str(window),
                                             "DEEPINFER_MAX_NUM_SEQS": str(args.seqs)}))
    await cluster.start()
    try:
        nc = await connect(cluster.nats_url, "bench")
        calm = [req(1000 + i, prompts[-1 - i][:64], args.calm_tokens) for i in range(args.calm)]
        idle = [(await ttft(nc, r, "calm"))[0] for r in calm]
        t0 = time.perf_counter()
        rng = random.Random(7)
        flood = [asyncio.create_task(ttft(nc, req(i, prompts[i % len(prompts)],
                                                  rng.randint(args.flood_tokens // 4, args.flood_tokens * 7 // 4)),
                                          "flood"))
                 for i in range(args.flood)]
        await asyncio.sleep(1.0)
        during = []
        for i, r in enumerate(calm):  # a steady trickle: one every --calm-every s, each on its own
            during.append(asyncio.create_task(ttft(nc, req(2000 + i, r.prompt_token_ids, args.calm_tokens), "calm")))
            await asyncio.sleep(args.calm_every)
        loaded = [t for t, _ in await asyncio.gather(*during)]
        flood_out = sum(n for _, n in await asyncio.gather(*flood))
        wall = time.perf_counter() - t0
        await nc.close()
    finally:
        await asyncio.to_thread(cluster.stop)
    return {"idle": idle, "loaded": loaded, "flood_tok_s": flood_out / wall}


async def main_async(args) -> None:
    prompts = load_prompt_set("distinct", 64)
    print(f"flood: {args.flood} requests x ~{args.flood_tokens} tokens at once; calm: {args.calm} requests x "
          f"{args.calm_tokens} tokens, one every {args.calm_every:.1f} s; one decode worker, max_num_seqs {args.seqs}")
    results = {}
    for name, window in (("fair gate", 0), ("no gate", -1)):
        r = results[name] = await one_run(window, args, prompts)
        print(f"  {name:<9}: calm TTFT idle p50 {statistics.median(r['idle']) * 1000:6.0f} ms; during the flood "
              f"p50 {statistics.median(r['loaded']) * 1000:6.0f} ms, p99 {pct(r['loaded'], 0.99) * 1000:6.0f} ms; "
              f"flood {r['flood_tok_s']:.1f} out tok/s")
    fair, none = results["fair gate"], results["no gate"]
    print(f"calm TTFT p50 during the flood: {statistics.median(none['loaded']) / statistics.median(fair['loaded']):.1f}x"
          f" lower with the gate; flood throughput {fair['flood_tok_s'] / none['flood_tok_s']:.2f}x of no gate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=64)
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--calm", type=int, default=8)
    ap.add_argument("--calm-tokens", type=int, default=8)
    ap.add_argument("--calm-every", type=float, default=1.0, help="seconds between calm requests during the flood")
    ap.add_argument("--seqs", type=int, default=16, help="the decode worker's max_num_seqs (the gate's window)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
