"""`deepinfer simulate`: replay a Mooncake-format trace (or a synthetic workload) through the placement policies in
the simulator, optionally on an elastic disaggregated cluster (live migration, the online P:D planner)."""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable

from cli.traces import DEFAULT_TRACE_HELP, resolve_trace


def add_parser(subparsers) -> argparse.ArgumentParser:
    from services.router.policy.policies import POLICIES
    from services.router.policy.profiles import PROFILES

    p = subparsers.add_parser("simulate", help="simulate a cluster on a request trace (no hardware needed)")
    p.add_argument("--trace", default=None, help=DEFAULT_TRACE_HELP)
    p.add_argument("--workload", default="trace", choices=("trace", "shifting", "agent"),
                   help="trace: replay --trace; shifting: the synthetic chat -> agent -> chat mix; agent: tool-calling "
                   "agent sessions resending a growing context, 77K tokens on average (simulator/workloads.py; "
                   "--speed scales their rates, --seed seeds them)")
    p.add_argument("--write-trace", default=None, metavar="PATH",
                   help="also write the workload's requests as Mooncake JSONL (for a live replay, e.g. "
                   "benchmarks/tier_replay.py --trace PATH)")
    p.add_argument("--workers", type=int, default=8, help="aggregated workers (when --prefill is 0)")
    p.add_argument("--prefill", type=int, default=0, help="prefill workers (disaggregated; 0 = aggregated)")
    p.add_argument("--decode", type=int, default=None, help="decode workers when --prefill > 0 (default --workers)")
    p.add_argument("--policy", default="all", help=f"comma list or 'all' of: {', '.join(POLICIES)}")
    p.add_argument("--profile", default="llama70b-h200", choices=sorted(PROFILES))
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--kv-capacity-blocks", type=int, default=None, help="KV blocks per worker")
    cap.add_argument("--kv-capacity-frac", type=float, default=0.3,
                     help="total KV capacity as a fraction of the trace's distinct blocks (default 0.3)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (0 = none)")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds (0 = none)")
    tier = p.add_argument_group("cache tier", "the shared DRAM + SSD block store (default: none); a DRAM block "
                                "pushed out is written to SSD, an SSD hit is promoted into DRAM")
    dram = tier.add_mutually_exclusive_group()
    dram.add_argument("--tier-dram-blocks", type=int, default=None, metavar="N",
                      help="tier DRAM capacity (default: 1/8 of the SSD's; 0 with an SSD = write-through)")
    dram.add_argument("--cache-tier-blocks", type=int, default=None, metavar="N",
                      help="older name of --tier-dram-blocks (alone: a DRAM-only tier of N blocks)")
    ssd = tier.add_mutually_exclusive_group()
    ssd.add_argument("--tier-ssd-blocks", type=int, default=0, metavar="N", help="tier SSD capacity in blocks")
    ssd.add_argument("--tier-frac", type=float, default=None, metavar="F",
                     help="tier SSD capacity as a fraction of the trace's distinct blocks")
    tier.add_argument("--retention", default=None, metavar="CLASS",
                      help="retention class of every request (default agent for --workload agent, else chat)")
    tier.add_argument("--retention-spec", default=None, metavar="SPEC",
                      help="class ttls, e.g. 'chat=7d,agent=3d,none=0' (default: the block store's)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--speed", type=float, default=1.0, help="arrival-rate multiplier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--offset", type=int, default=0, help="skip this many requests first (a later window)")
    p.add_argument("--price-cached", type=float, default=0.02,
                   help="per million cached input tokens (accounting.Prices; the JSON's accounting ledger)")
    p.add_argument("--price-uncached", type=float, default=1.0, help="per million uncached input tokens")
    p.add_argument("--price-output", type=float, default=0.0, help="per million output tokens")
    p.add_argument("--currency-per-usd", type=float, default=1.0,
                   help="units of the prices' currency per US dollar (e.g. 7.2 for prices in yuan; default 1)")
    p.add_argument("--gpu-hour-price", type=float, default=2.0,
                   help="rent of one GPU for an hour in dollars (default 2, the seed's H800 figure): revenue, "
                   "rent and margin per GPU-hour in the JSON's economics")
    p.add_argument("--what-if", default=None, metavar="SPEC",
                   help="a grid of runs of the first policy, e.g. 'tier=0,0.1,0.5;retention=7d,3d,1d;pd=0:8,2:6' "
                   "(tier: SSD capacity as a fraction of the distinct blocks; retention: the ttl of every request; "
                   "pd: prefill:decode workers, 0:D aggregated): hit rate, GPU-hours and money per cell "
                   "(simulator/what_if.py); --plot then draws revenue and hit rate against the tier's size")
    elastic = p.add_argument_group("elastic cluster", "disaggregated only (--prefill > 0): the router's own "
                                   "live-migration policy and P:D planner, run every --tick simulated seconds")
    elastic.add_argument("--migrate", action="store_true", help="live-migrate decode streams (drain, KV, skew)")
    elastic.add_argument("--planner", action="store_true",
                         help="the online P:D planner switches workers between prefill and decode")
    elastic.add_argument("--tick", type=float, default=1.0, help="seconds between evaluations (default 1)")
    elastic.add_argument("--startup", type=float, default=30.0,
                         help="seconds a worker the planner adds takes to start (default 30)")
    cls = p.add_argument_group("SLO classes", "requests drawn a class of a mix (shared/slo_classes.py)")
    cls.add_argument("--classes", default=None, metavar="MIX",
                     help="e.g. 'interactive=0.2,batch=0.8': workers queue by class, attainment per class")
    cls.add_argument("--slo-classes", default="", metavar="SPEC", help="the classes (default: the router's)")
    cls.add_argument("--classes-off", action="store_true",
                     help="count requests by class but queue them in arrival order (today's one priority)")
    p.add_argument("--json", action="store_true", help="print only the JSON lines")
    p.add_argument("--plot", default=None,
                   help="write the TTFT CDF of every policy to this PNG (matplotlib: the plot extra)")
    return p


def tier_blocks(args: argparse.Namespace, distinct: int) -> tuple[int, int]:
    """(DRAM, SSD) tier capacities in blocks from the flags. DRAM defaults to 1/8 of the SSD (host DRAM to
    NVMe capacity of a typical storage node)."""
    ssd = math.ceil(args.tier_frac * distinct) if args.tier_frac is not None else args.tier_ssd_blocks
    if args.cache_tier_blocks is not None:
        return args.cache_tier_blocks, ssd
    return (args.tier_dram_blocks if args.tier_dram_blocks is not None else math.ceil(ssd / 8)), ssd


def load_workload(args: argparse.Namespace) -> list:
    """The requests to replay: the trace file (``--limit``, ``--offset``, ``--speed``) or the shifting workload
    (``--speed`` compresses its clock, ``--limit`` keeps its first requests)."""
    from simulator.trace import load_trace
    from simulator.workloads import agent_workload, shifting_workload

    if args.workload == "trace":
        return load_trace(resolve_trace(args.trace), limit=args.limit, speed=args.speed, offset=args.offset)
    make = agent_workload if args.workload == "agent" else shifting_workload
    trace = [dataclasses.replace(r, arrival_s=r.arrival_s / args.speed)
             for r in make(seed=args.seed, block_size=args.block_size)]
    return trace[:args.limit] if args.limit is not None else trace


def elastic_summary(res: dict) -> str:
    """One line on what migration and the planner did in a run."""
    parts = [f"{res['policy']}:"]
    if "migrations" in res:
        m = res["migrations"]
        parts.append(f"migrations {m['moves']} {m['by_reason']} pause {m['pause_s_total']:.2f} s;")
    if "planner" in res:
        pl = res["planner"]
        moves = ", ".join(f"{d['t_s']:.0f}s {d['kind']} {d['worker']}->{d['role']}" if d["kind"] == "switch"
                          else f"{d['t_s']:.0f}s {d['role']} {d['delta']:+d}" for d in pl["decisions"])
        parts.append(f"planner {len(pl['decisions'])} decisions [{moves}], "
                     f"final P:D {pl['final_prefill']}:{pl['final_decode']}")
    return " ".join(parts)


def run(args: argparse.Namespace, emit: Callable[..., None]) -> int:
    """Run the subcommand; all terminal output goes through ``emit`` (print-like; the CLI passes print)."""
    from shared.accounting import Prices
    from shared.errors import DeepinferError
    from shared.retention import RetentionPolicy
    from services.router.policy.policies import POLICIES
    from simulator.economics import Economics
    from simulator.simulate import (MigrationConfig, PlannerConfig, distinct_blocks, format_table, json_line,
                                        plot_ttft_cdf, simulate)
    from simulator.what_if import parse_grid

    names = list(POLICIES) if args.policy == "all" else [n.strip() for n in args.policy.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        emit(f"deepinfer simulate: unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}",
              file=sys.stderr)
        return 2
    try:
        trace = load_workload(args)
    except OSError as err:
        emit(f"deepinfer simulate: cannot read trace: {err}", file=sys.stderr)
        return 2
    if not trace:
        emit("deepinfer simulate: empty trace", file=sys.stderr)
        return 2
    if args.retention is None:   # the seed's classes: agent sessions 3 days, chat 7
        args.retention = "agent" if args.workload == "agent" else "chat"
    if args.write_trace:
        from simulator.trace import write_trace

        try:
            emit(f"wrote {write_trace(trace, args.write_trace)} requests to {args.write_trace}", file=sys.stderr)
        except OSError as err:
            emit(f"deepinfer simulate: cannot write trace: {err}", file=sys.stderr)
            return 2
    prefill = max(0, args.prefill)
    if (args.migrate or args.planner) and not prefill:
        emit("deepinfer simulate: --migrate and --planner need a disaggregated cluster (--prefill > 0)",
             file=sys.stderr)
        return 2
    workers = (args.decode if args.decode is not None else args.workers) if prefill else args.workers
    cap = args.kv_capacity_blocks
    if cap is None:
        cap = max(1, math.ceil(args.kv_capacity_frac * distinct_blocks(trace) / (workers + prefill)))
    dram, ssd = tier_blocks(args, distinct_blocks(trace))
    try:
        retention_policy = RetentionPolicy.from_spec(args.retention_spec) if args.retention_spec else None
        prices = Prices(args.price_cached, args.price_uncached, args.price_output)
        economics = Economics(args.gpu_hour_price, args.currency_per_usd)
        own_ttl = f"{(retention_policy or RetentionPolicy()).ttl(args.retention):g}s"   # the run's own class
        cells = parse_grid(args.what_if, args.tier_frac or 0.0, own_ttl, prefill, workers) if args.what_if else None
        if min(dram, ssd) < 0:
            raise ValueError(f"tier capacities must be >= 0 blocks, got dram={dram} ssd={ssd}")
        if args.tick <= 0 or args.startup < 0:
            raise ValueError(f"--tick must be > 0 and --startup >= 0, got {args.tick} and {args.startup}")
        (retention_policy or RetentionPolicy()).ttl(args.retention)
        from simulator.classes import ClassMix

        mix = ClassMix.parse(args.classes, args.slo_classes, on=not args.classes_off,
                             ttft_slo_s=args.ttft_slo or None) if args.classes else None
    except (DeepinferError, ValueError) as err:
        emit(f"deepinfer simulate: {err}", file=sys.stderr)
        return 2
    common = dict(num_workers=workers, kv_capacity_blocks=cap, ttft_slo_s=args.ttft_slo or None,
                  tpot_slo_s=args.tpot_slo or None, seed=args.seed, speed=args.speed, prefill_workers=prefill,
                  block_size=args.block_size, prices=prices, retention=args.retention,
                  retention_policy=retention_policy, tick_s=args.tick, startup_s=args.startup,
                  migration=MigrationConfig() if args.migrate else None,
                  planner=PlannerConfig(ttft_slo_s=args.ttft_slo or 2.0, tpot_slo_s=args.tpot_slo or 0.1)
                  if args.planner else None, economics=economics, classes=mix)
    if cells is not None:
        return _run_what_if(args, emit, trace, cells, names[0], common)
    results = []
    for name in names:
        t0 = time.perf_counter()
        res = simulate(trace, name, args.profile, tier_dram_blocks=dram, tier_ssd_blocks=ssd, **common)
        if dram or ssd:  # the same run without the tier
            res["hit_rate_no_tier"] = simulate(trace, name, args.profile, **common)["hit_rate"]
        results.append(res)
        emit(json_line(res), flush=True)
        emit(f"# {name}: simulated in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    if not args.json:
        emit(format_table(results))
        if mix is not None:
            from simulator.classes import format_classes

            emit(format_classes(results))
        for res in results:
            if "migrations" in res or "planner" in res:
                emit(elastic_summary(res))
    return _plot(plot_ttft_cdf, results, args.plot, emit)


def _plot(draw: Callable[[list, str], None], results: list, path: str | None, emit: Callable[..., None]) -> int:
    """``draw(results, path)`` when ``--plot`` names a file: exit status 0, or 2 without matplotlib."""
    if not path:
        return 0
    try:
        draw(results, path)
    except RuntimeError as err:
        emit(f"deepinfer simulate: {err}", file=sys.stderr)
        return 2
    emit(f"wrote {path}")
    return 0


def _run_what_if(args: argparse.Namespace, emit: Callable[..., None], trace: list, cells: list, policy: str,
                 common: dict) -> int:
    """``--what-if``: one run of ``policy`` per cell; JSON lines, the table, the optional plot."""
    import json

    from simulator.what_if import format_what_if, plot_what_if, what_if

    knobs = {k: v for k, v in common.items() if k not in ("num_workers", "prefill_workers", "retention",
                                                           "retention_policy")}
    t0 = time.perf_counter()
    rows = what_if(trace, cells, policy, args.profile, **knobs)
    for row in rows:
        emit(json.dumps({"what_if": row, "policy": policy, "profile": args.profile}, sort_keys=True), flush=True)
    emit(f"# what-if: {len(rows)} runs of {policy} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if not args.json:
        emit(f"what-if: policy={policy} profile={args.profile} requests={len(trace)} "
             f"kv_blocks/worker={common['kv_capacity_blocks']} GPU-hour ${args.gpu_hour_price:g}")
        emit(format_what_if(rows))
    return _plot(plot_what_if, rows, args.plot, emit)
