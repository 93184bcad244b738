"""Measure this machine's engine step times and fit the simulator's ``smollm2-cpu`` profile constants.

    python -m benchmarks.calibrate_profile [--threads 1] [--reps 2]

Measures, with the engine one worker process would run (``--threads`` torch threads, 1024-token budget):
- prefill of T fresh tokens in one step (no cached context), T = 16 … 1024  → a, b, c of a*T^2 + b*T + c;
- one chunk of c tokens after ctx tokens already cached (prefix hit)      → the context term a_ctx*c*ctx;
- decode steps of B sequences holding K cached tokens in total           → base + per_seq*B + per_kv*K.
Prints every sample beside the current profile's prediction (ratio), then the fitted constants as JSON.
A benchmark, not a test: the numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import time

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from services.router.policy.profiles import SMOLLM2_CPU, Profile, calibrate_chunks, calibrate_decode

logger = logging.getLogger("calibrate_profile")
_rng = random.Random(0)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 49_000) for _ in range(n)]


def _timed_first_step(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds of the step that computes ``prompt``'s uncached tokens (they must fit one step's budget)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    while rid in engine.requests and engine.has_unfinished():
        engine.step()
    return dt


def measure_prefill(engine: LLMEngine, sizes, reps: int) -> list[tuple[int, float]]:
    return [(t, statistics.median(_timed_first_step(engine, _tokens(t)) for _ in range(reps))) for t in sizes]


def measure_chunks(engine: LLMEngine, contexts, chunks, reps: int) -> list[tuple[int, int, float]]:
    """(ctx, c, seconds): a prefix of ctx tokens is computed and cached first, then ctx + c tokens run."""
    out = []
    for ctx in contexts:
        prefix = _tokens(ctx)
        engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        for c in chunks:
            secs = [_timed_first_step(engine, prefix + _tokens(c)) for _ in range(reps)]
            out.append((ctx, c, statistics.median(secs)))
    return out


def measure_decode(engine: LLMEngine, shapes, steps: int = 6) -> list[tuple[int, int, float]]:
    """(batch, kv tokens, seconds per decode step) with ``batch`` sequences of ``prompt`` tokens each."""
    out = []
    for batch, prompt_len in shapes:
        params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request(_tokens(prompt_len), params) for _ in range(batch)]
        while any(engine.requests[r].num_computed_tokens < prompt_len for r in rids if r in engine.requests):
            engine.step()  # prefill every sequence first (the first token comes with it)
        kv = sum(engine.requests[r].num_computed_tokens for r in rids)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out.append((batch, kv + batch * steps // 2, (time.perf_counter() - t0) / steps))
        while engine.has_unfinished():
            engine.step()
    return out


def fit(prefill, chunks, decode) -> dict:
    a, ctx_a, b, c = calibrate_chunks([(0, t, s) for t, s in prefill] + list(chunks))
    base, per_seq, per_kv = calibrate_decode(decode)
    return {"prefill_a": a, "prefill_b": b, "prefill_c": c, "prefill_ctx_a": ctx_a, "decode_base_s": base,
            "decode_per_seq_s": per_seq, "decode_per_kv_token_s": per_kv}


def report(profile: Profile, prefill, chunks, decode) -> None:
    """Every sample beside ``profile``'s prediction (predicted / measured)."""
    for t, s in prefill:
        pred = profile.prefill_s(t)
        logger.info("  prefill T=%-5d %7.3f s  predicted %7.3f s  %.2fx", t, s, pred, pred / s)
    for ctx, n, s in chunks:
        pred = profile.prefill_c + profile.chunk_s(ctx, n)
        logger.info("  chunk ctx=%-5d n=%-5d %7.3f s  predicted %7.3f s  %.2fx", ctx, n, s, pred, pred / s)
    for bt, kv, s in decode:
        pred = profile.decode_step_s(bt, kv)
        logger.info("  decode B=%-3d K=%-6d %7.4f s  predicted %7.4f s  %.2fx", bt, kv, s, pred, pred / s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (deepinfer up gives each worker 1 here)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--save", help="write the measured samples (JSON) here")
    ap.add_argument("--load", help="refit from samples saved with --save instead of measuring")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        prefill, chunks, decode = (saved[k] for k in ("prefill", "chunks", "decode"))
    else:
        engine = LLMEngine.from_path(None, EngineConfig(num_threads=args.threads, kv_cache_bytes=2 << 30,
                                                        max_num_batched_tokens=1024, max_num_seqs=64))
        measure_prefill(engine, (64, 256), 1)  # warm-up: kernels built, weights packed
        prefill = measure_prefill(engine, (16, 64, 128, 256, 512, 768, 1024), args.reps)
        chunks = measure_chunks(engine, (512, 1024, 2048, 3072), (128, 512, 1024), args.reps)
        decode = measure_decode(engine, ((1, 64), (4, 64), (8, 64), (16, 64), (32, 64), (8, 512), (16, 512)))
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"threads": args.threads, "prefill": prefill, "chunks": chunks, "decode": decode}, f)
    fitted = fit(prefill, chunks, decode)
    logger.info("profile %s as it stands:", SMOLLM2_CPU.name)
    report(SMOLLM2_CPU, prefill, chunks, decode)
    logger.info("refitted (relative least squares):")
    report(dataclasses.replace(SMOLLM2_CPU, **fitted), prefill, chunks, decode)
    logger.info("%s", json.dumps({"threads": args.threads, **fitted}))


if __name__ == "__main__":
    main()
