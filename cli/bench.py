"""`deepinfer bench`: replay a Mooncake-format trace (scaled down) against a running cluster and report the
simulator's metrics, optionally next to the simulator's prediction for the same scaled requests."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable

from cli.flags import add_nats_url, deprecated
from cli.traces import DEFAULT_TRACE_HELP, resolve_trace
from shared.engine.config import DEFAULT_KV_CACHE_MB


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="replay a trace against a running cluster and measure TTFT/TPOT")
    p.add_argument("--trace", default=None, help=DEFAULT_TRACE_HELP)
    add_nats_url(p, "the running cluster's NATS server", required=True)
    p.add_argument("--limit", type=int, default=100, help="first N requests only")
    p.add_argument("--offset", type=int, default=0, help="skip this many requests first (a later window)")
    p.add_argument("--scale", type=int, default=32, help="divide lengths by this (512/scale tokens per block)")
    p.add_argument("--speed", type=float, default=1.0, help="arrival-rate multiplier (time compression)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (0 = none)")
    p.add_argument("--tpot-slo", type=float, default=0.2, help="seconds (0 = none)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout_s")
    p.add_argument("--prefill-mode", default="auto", choices=["auto", "local", "remote"])
    p.add_argument("--retention", default="", help="retention class of every request ('' = router default)")
    p.add_argument("--seed", type=int, default=0, help="token synthesis seed")
    p.add_argument("--classes", default=None, metavar="MIX",
                   help="SLO classes drawn per request, e.g. 'interactive=0.2,batch=0.8' (attainment per class)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--simulate", action="store_true", help="also simulate the same scaled requests")
    p.add_argument("--sim-profile", default="smollm2-cpu", help="simulator profile (with --simulate)")
    deprecated(p, "--profile", "--sim-profile", "sim_profile")
    p.add_argument("--profile-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a profile constant for the simulation, e.g. prefill_b=0.004 (repeatable)")
    p.add_argument("--save", default=None, help="write the per-request results (JSON) here")
    p.add_argument("--sim-policy", default="least_loaded", help="simulator placement policy")
    p.add_argument("--sim-prefill", type=int, default=0, help="simulated prefill workers (0 = aggregated)")
    p.add_argument("--sim-decode", type=int, default=1, help="simulated decode (or aggregated) workers")
    p.add_argument("--sim-kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB,
                   help="simulated per-worker KV cache (the cluster's --kv-cache-mb)")
    for old in ("prefill", "decode", "kv-cache-mb"):
        deprecated(p, f"--{old}", f"--sim-{old}", f"sim_{old.replace('-', '_')}", type=int)
    p.add_argument("--json", action="store_true", help="print only the JSON lines")
    return p


def scaled_trace(trace, reqs, scale: int):
    """TraceRequests for the simulator with the scaled lengths (block size 512/scale, same hash ids)."""
    from simulator.simulate import TraceRequest

    return [TraceRequest(t.idx, arrival, len(prompt), max_tokens, t.hash_ids)
            for t, (arrival, prompt, max_tokens) in zip(trace, reqs)]


def simulate_scaled(trace, reqs, args) -> dict:
    from services.router.policy.profiles import get_profile
    from cli.replay import TRACE_BLOCK
    from simulator.simulate import simulate

    prof = get_profile(args.sim_profile)
    if args.profile_set:
        import dataclasses

        kv = dict(item.split("=", 1) for item in args.profile_set)
        prof = dataclasses.replace(prof, **{k: type(getattr(prof, k))(v) for k, v in kv.items()})
    block = TRACE_BLOCK // args.scale
    cap = max(1, (args.sim_kv_cache_mb << 20) // prof.block_bytes(block))
    return simulate(scaled_trace(trace, reqs, args.scale), args.sim_policy, prof, num_workers=max(1, args.sim_decode),
                    kv_capacity_blocks=cap, ttft_slo_s=args.ttft_slo or None, tpot_slo_s=args.tpot_slo or None,
                    speed=args.speed, prefill_workers=max(0, args.sim_prefill), block_size=block)


async def _replay(args, reqs, classes: list[str] | None = None) -> tuple[list[dict], float]:
    from shared.bus import connect
    from cli.replay import replay

    nc = await connect(args.nats_url, "bench")
    try:
        t0 = time.perf_counter()
        results = await replay(nc, reqs, timeout_s=args.timeout, speed=1.0, prefill_mode=args.prefill_mode,
                               retention=args.retention, slo_classes=classes)
        return results, time.perf_counter() - t0
    finally:
        await nc.close()


def _ratio(sim, meas):
    return round(sim / meas, 4) if sim is not None and meas else None


def run(args: argparse.Namespace, emit: Callable[..., None]) -> int:
    """Run the subcommand; all terminal output goes through ``emit`` (print-like; the CLI passes print)."""
    from cli.replay import metrics_from_replay, scaled_requests
    from simulator.metrics import format_table, json_line
    from simulator.simulate import load_trace

    try:
        # arrivals come out already divided by speed
        trace = load_trace(resolve_trace(args.trace), limit=args.limit, speed=args.speed, offset=args.offset)
        reqs = scaled_requests(trace, scale=args.scale, vocab=args.vocab, seed=args.seed)
    except (OSError, ValueError) as err:
        emit(f"deepinfer bench: {err}", file=sys.stderr)
        return 2
    if not reqs:
        emit("deepinfer bench: empty trace", file=sys.stderr)
        return 2
    mix = assigned = None
    if args.classes:
        from simulator.classes import ClassMix

        try:
            mix = ClassMix.parse(args.classes, ttft_slo_s=args.ttft_slo or None)
        except ValueError as err:
            emit(f"deepinfer bench: {err}", file=sys.stderr)
            return 2
        assigned = mix.assign(len(reqs), args.seed)
    results, wall = asyncio.run(_replay(args, reqs, assigned))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f)
    measured = metrics_from_replay(
        results, args.ttft_slo or None, args.tpot_slo or None, trace=scaled_trace(trace, reqs, args.scale),
        label="measured", speed=args.speed, workers=max(1, args.sim_decode), prefill_workers=max(0, args.sim_prefill),
        replay_wall_s=round(wall, 3), scale=args.scale)
    if mix is not None:   # attainment per class against each class's own targets (the simulator's rule)
        from simulator.classes import class_metrics

        measured["classes"] = class_metrics(mix, assigned, [(i, r["ttft_s"], r["tpot_s"])
                                                             for i, r in enumerate(results) if not r["error"]])
    rows = [measured]
    emit(json_line(measured), flush=True)
    if args.simulate:
        sim = simulate_scaled(trace, reqs, args)
        sim["policy"] = f"sim:{args.sim_policy}"
        rows.append(sim)
        emit(json_line(sim), flush=True)
        cmp = {"ttft_p50_ratio": _ratio(sim.get("ttft_p50_s"), measured.get("ttft_p50_s")),
               "tpot_p50_ratio": _ratio(sim.get("tpot_p50_s"), measured.get("tpot_p50_s"))}
        emit(json.dumps({"simulated_over_measured": cmp}), flush=True)
    if not args.json:
        m = dict(measured)
        m.setdefault("profile", "live")
        m["kv_capacity_blocks"] = rows[-1]["kv_capacity_blocks"] if args.simulate else "-"
        emit(format_table([m] + rows[1:]))
        if measured["errors"]:
            emit(f"errors: {measured['error_codes']}")
        if args.simulate:
            emit(f"simulated/measured: ttft p50 {cmp['ttft_p50_ratio']}  tpot p50 {cmp['tpot_p50_ratio']}")
    return 0
