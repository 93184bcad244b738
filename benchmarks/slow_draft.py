"""What a bad draft service costs decoding: plain decoding vs remote speculation against a draft service that is
slow or dead, side by side on the same prompts (SmolLM2-135M fp32, greedy, the bench set's first prompts).

The "draft service" here answers over a real nats-server, ``--delay`` seconds late (fault injection: slower than
the worker's 0.1 s draft timeout), or not at all (dead). Runs, each on a fresh in-process engine:
- plain: no speculation (the baseline);
- slow, breaker: the remote drafter as shipped (``shared/spec/breaker.py``);
- dead, breaker: no responder at all;
- slow, no breaker: the breaker disabled (threshold beyond reach), i.e. the drafter before the breaker.

Plain runs are interleaved (first, third, last): their spread is this machine's noise. Prints tokens/s, the ratio
against the plain runs' mean, the share of the run the engine thread spent blocked on the service (the cost
itself, free of that noise), and whether outputs equal plain decoding's (they must).

    python -m benchmarks.slow_draft [--prompts 8] [--new-tokens 96] [--delay 0.3]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

from benchmarks.engine_throughput import load_prompt_set
from shared import protocol, subjects
from shared.bus import connect
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.engine.speculator import SpecConfig, Speculator
from shared.nats_server import EmbeddedNatsServer
from shared.spec.breaker import CircuitBreaker
from shared.spec.confidence import FixedK
from shared.spec.remote import RemoteDrafter, reply_for, sequences_of
from shared.spec.types import Proposal

SUBJECT = subjects.draft("bench")
log = logging.getLogger("bench")


async def slow_service(url: str, delay_s: float):
    """Fault injection: a draft service that proposes nothing, ``delay_s`` late."""
    nc = await connect(url, "slow-draft")

    async def on_msg(msg) -> None:
        req = protocol.decode(msg.data, protocol.DraftRequest)
        await asyncio.sleep(delay_s)
        await msg.respond(protocol.encode(reply_for([Proposal() for _ in sequences_of(req)])))
    await nc.subscribe(SUBJECT, cb=on_msg)
    return nc


async def run(url: str, prompts: list[list[int]], new_tokens: int, variant: str) -> tuple[float, list, dict]:
    """``(tokens/s, outputs, drafter counters)`` on a fresh engine, generating on a thread (the engine thread)
    while this loop serves the drafter's NATS requests."""
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", device="cpu"))
    nc = await connect(url, "bench-worker")
    drafter = None
    if variant != "plain":
        breaker = CircuitBreaker(threshold=10 ** 9) if variant.endswith("no breaker") else CircuitBreaker()
        drafter = RemoteDrafter(nc, asyncio.get_running_loop(), SUBJECT, timeout_s=0.1, breaker=breaker)
        engine.set_speculator(Speculator(drafter, SpecConfig(k=5, max_batch=len(prompts)), FixedK(5)))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    await asyncio.to_thread(engine.generate, [prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    outputs = await asyncio.to_thread(engine.generate, prompts, params)
    wall = time.perf_counter() - t0
    await nc.close()
    counters = {"wall_s": round(wall, 2)}
    if drafter is not None:
        counters.update(waited_s=round(drafter.waited_s, 3), timeouts=drafter.timeouts, slow=drafter.slow,
                        skipped=drafter.breaker.skipped, opened=drafter.breaker.opened)
    return sum(len(o) for o in outputs) / wall, outputs, counters


async def main_async(args) -> None:
    prompts = load_prompt_set("distinct", args.prompts)
    with EmbeddedNatsServer() as server:
        server.start()
        service = await slow_service(server.url, args.delay)
        results = {}
        for variant in ("plain", "slow, breaker", "plain", "slow, no breaker"):
            results.setdefault(variant, []).append(await run(server.url, prompts, args.new_tokens, variant))
        await service.close()
        for variant in ("dead, breaker", "plain"):
            results.setdefault(variant, []).append(await run(server.url, prompts, args.new_tokens, variant))
    plain = [tps for tps, _, _ in results["plain"]]
    base, ref = sum(plain) / len(plain), results["plain"][0][1]
    print(f"{len(prompts)} concurrent streams x {args.new_tokens} tokens, draft service {args.delay:.2f} s late "
          f"(timeout 0.1 s); plain runs {', '.join(f'{t:.1f}' for t in plain)} tok/s (their spread is the noise):")
    for variant, runs in results.items():
        for tps, out, counters in runs:
            same = sum(a == b for a, b in zip(out, ref))
            cost = counters.get("waited_s", 0.0) / counters["wall_s"]
            print(f"  {variant:<17} {tps:6.1f} tok/s  ratio {tps / base:.3f}x of the plain mean  engine thread "
                  f"blocked on the service {100 * cost:4.1f}% of the run  identical outputs {same}/{len(ref)}  "
                  f"{counters}")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="concurrent streams (speculation runs up to 8)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--delay", type=float, default=0.3, help="seconds the slow service takes per request")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
