"""The engine beside a process that wants a core: output tokens/s of the in-process engine (SmolLM2-135M fp32, the
bench prompt set, greedy) alone and with one busy-loop process on the same host, per OpenMP policy — the
threads spinning at barriers (libgomp's default, ``OMP_WAIT_POLICY`` unset), sleeping there (``PASSIVE``), and
one thread fewer than the cores. Each run is a fresh process (the policy is read when torch starts), after a
warm-up pass; the ratio loaded / alone is what to compare (issue 36 asks >= 0.8 x (N - 1) / N).

With ``--served``: the same through ``deepinfer up``'s processes (router, one aggregated decode worker, the plain
NATS API at concurrency 16), the policy set in the worker's environment.

    python -m benchmarks.colocated_load [--prompts 32] [--tokens 32] [--served]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

logger = logging.getLogger("colocated_load")

RUN = r"""
import json, sys, time, torch
from benchmarks.engine_throughput import load_prompt_set
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
threads, prompts, tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", max_num_seqs=16))
ids = load_prompt_set("distinct", prompts)
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
engine.generate(ids[:4], params)   # warm-up
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()               # the busy loop (if any) is running now
t0 = time.perf_counter()
out = engine.generate(ids, params)
wall = time.perf_counter() - t0
print(json.dumps({"tok_s": sum(len(o) for o in out) / wall, "wall_s": wall}))
"""


def measure(env_extra: dict[str, str], threads: int, busy: bool, args) -> float:
    env = {**os.environ, **env_extra, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(threads), str(args.prompts), str(args.tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        time.sleep(0.5 if busy else 0.0)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        proc.wait(timeout=60)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    return result["tok_s"]


async def served_run(env_extra: dict[str, str], busy: bool, args) -> float:
    import asyncio

    from benchmarks.engine_throughput import load_prompt_set
    from cli.launcher import Cluster, ClusterSpec
    from shared import protocol
    from shared.bus import connect
    from shared.client import generate

    cluster = Cluster(ClusterSpec(prefill=0, decode=1, cache_tier=0, metrics=False, http_port=-1, extra_env=env_extra))
    await cluster.start()
    loop = None
    try:
        nc = await connect(cluster.nats_url, "bench")
        ids = load_prompt_set("distinct", args.prompts)
        limit = asyncio.Semaphore(16)

        async def one(i: int, p: list[int]) -> int:
            async with limit:
                req = protocol.GenerateRequest(prompt_token_ids=p, max_tokens=args.tokens, temperature=0.0,
                                               ignore_eos=True, request_id=f"r{i}-{busy}", timeout_s=600.0)
                return len((await generate(nc, req))[0])
        await one(-1, ids[0])   # warm-up
        if busy:
            loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(ids)))
        tok_s = sum(done) / (time.perf_counter() - t0)
        await nc.close()
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
        await asyncio.to_thread(cluster.stop)
    return tok_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--served", action="store_true", help="through deepinfer up's processes")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    cores = os.cpu_count() or 1
    policies = [("spinning (OMP_WAIT_POLICY unset)", {}, cores),
                ("passive (OMP_WAIT_POLICY=PASSIVE)", {"OMP_WAIT_POLICY": "PASSIVE"}, cores),
                ("short spin (GOMP_SPINCOUNT=10000)", {"GOMP_SPINCOUNT": "10000"}, cores),
                ("short spin (GOMP_SPINCOUNT=100000)", {"GOMP_SPINCOUNT": "100000"}, cores),
                (f"{max(1, cores - 1)} thread(s), spinning", {}, max(1, cores - 1))]
    logger.info("%d cores; %d prompts x %d tokens; one busy-loop process beside the loaded runs", cores,
                args.prompts, args.tokens)
    if args.served:
        import asyncio

        policies = [(n, e, t) for n, e, t in policies if t == cores and "GOMP" not in str(e)]
    for name, env, threads in policies:
        if args.served:
            alone, loaded = (asyncio.run(served_run(env, busy, args)) for busy in (False, True))
        else:
            alone = measure(env, threads, False, args)
            loaded = measure(env, threads, True, args)
        logger.info("  %-34s alone %6.1f tok/s, with a busy loop %6.1f tok/s (%.2fx; target >= %.2fx)", name, alone,
                    loaded, loaded / alone, 0.8 * (cores - 1) / cores)


if __name__ == "__main__":
    main()
