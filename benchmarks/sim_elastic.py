"""Elastic disaggregated cluster in the simulator: does live migration + the online P:D planner beat a fixed split?

For the Mooncake trace at each ``--speeds`` arrival rate and for the shifting chat -> agent -> chat workload
(``simulator/workloads.py``), one run each on ``--workers`` workers (``--prefill`` of them prefill):

- ``fixed``: the split as configured, plain simulator (the evaluation tick alone changes nothing: a stream
  handed off to a busy decode worker joins its batch at the next step boundary, tick or not);
- ``migrate``, ``planner``, ``migrate+planner``: the router's policies from that split;
- ``best fixed``: the best split (most requests within both SLOs, then goodput) of a sweep over prefill = 1 ..
  workers-1.

Columns: TTFT attainment (requests with TTFT <= SLO, of all), TPOT attainment (of requests with a TPOT), both
SLOs, goodput (requests within both SLOs per second), TTFT / TPOT p99, migrations and planner decisions (each
with the prefill / decode pressures it was made at).

Then a scale run: ``--scale-workers`` workers on the trace tiled ``--scale-copies`` times (copy c: hash ids
shifted past every id of the trace, arrivals shifted by c/copies of the mean gap, so the copies interleave) over
the first ``--scale-window`` seconds, fixed and with migration + planner; prints simulator wall time per request
and placement time per request (``time.perf_counter`` around ``place_request``, and separately building the
views). Defaults take about 2 minutes on a 2-core machine; ``--scale-window 1000`` tiles the whole trace.

    python -m benchmarks.sim_elastic [--speeds 2,4] [--workers 8] [--prefill 4] [--policy kv_cost]
        [--scale-workers 1000] [--scale-window 30] [--scale-fixed-only] [--skip-scale] [--plot elastic.png]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import plots
from cli.traces import DEFAULT_TRACE_HELP, resolve_trace
from simulator.simulate import (MigrationConfig, PlannerConfig, TraceRequest, distinct_blocks, load_trace,
                                    simulate)
from simulator.workloads import shifting_workload


def attainment(res: dict) -> tuple[float, float]:
    """(TTFT attainment over all requests, TPOT attainment over requests that have a TPOT)."""
    ttft, tpot = res["ttft_slo_s"] or float("inf"), res["tpot_slo_s"] or float("inf")
    ok_ttft = sum(t <= ttft for t in res["_ttfts"]) / max(1, res["requests"])
    ok_tpot = sum(t <= tpot for t in res["_tpots"]) / max(1, len(res["_tpots"]))
    return ok_ttft, ok_tpot


def row(label: str, res: dict, wall_s: float) -> list[str]:
    a_ttft, a_tpot = attainment(res)
    mig = res.get("migrations", {})
    moves = " ".join(f"{k}={v}" for k, v in mig.get("by_reason", {}).items()) or ("0" if mig else "-")
    plan = res.get("planner")
    decisions = "-" if plan is None else (f"{len(plan['decisions'])} -> {plan['final_prefill']}:"
                                          f"{plan['final_decode']}")
    return [label, f"{a_ttft:.3f}", f"{a_tpot:.3f}", f"{res['slo_attainment']:.3f}", f"{res['goodput_rps']:.3f}",
            f"{res['ttft_p99_s']:.2f}", f"{res['tpot_p99_s']:.4f}", moves,
            f"{mig['pause_s_total']:.1f}" if mig else "-", decisions, f"{wall_s:.1f}"]


HEAD = ["run", "ttft att", "tpot att", "slo", "goodput/s", "ttft p99", "tpot p99", "moves", "pause s",
        "planner -> P:D", "wall s"]


def table(rows: list[list[str]]) -> str:
    rows = [HEAD] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def timed(trace, args, prefill: int, **kw) -> tuple[dict, float]:
    t0 = time.perf_counter()
    res = simulate(trace, args.policy, args.profile, num_workers=args.workers - prefill, prefill_workers=prefill,
                   ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo, tick_s=args.tick, **kw)
    return res, time.perf_counter() - t0


def compare(name: str, trace: list[TraceRequest], args) -> dict[str, dict]:
    """The table of one workload; returns each run's result by its label."""
    planner = PlannerConfig(ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo)
    both = {"migration": MigrationConfig(), "planner": planner}
    runs = [("fixed", {}), ("migrate", {"migration": MigrationConfig()}), ("planner", {"planner": planner}),
            ("migrate+planner", both)]
    rows, notes, results = [], [], {}
    for label, kw in runs:
        res, wall = timed(trace, args, args.prefill, **kw)
        rows.append(row(f"{label} {args.prefill}:{args.workers - args.prefill}", res, wall))
        results[f"{label} {args.prefill}:{args.workers - args.prefill}"] = res
        if "planner" in kw:
            notes.append(f"#   {label} decisions (pressures P/D): " + ", ".join(
                (f"{d['t_s']:.0f}s {d['worker']}->{d['role']}" if d["kind"] == "switch"
                 else f"{d['t_s']:.0f}s {d['role']} {d['delta']:+d}")
                + f" ({d['prefill_pressure']:.2f}/{d['decode_pressure']:.2f})" for d in res["planner"]["decisions"]))
    sweep_wall = time.perf_counter()
    best, scores = None, []
    for p in range(1, args.workers):
        res, wall = timed(trace, args, p)
        scores.append(f"{p}:{args.workers - p}={res['slo_attainment']:.3f}")
        if best is None or (res["slo_met"], res["goodput_rps"]) > (best[0]["slo_met"], best[0]["goodput_rps"]):
            best = (res, wall, p)
    res, wall, p = best
    rows.append(row(f"best fixed {p}:{args.workers - p}", res, wall))
    results[f"best fixed {p}:{args.workers - p}"] = res
    notes.append(f"#   sweep (slo attainment): {' '.join(scores)}")
    print(f"# {name}: {len(trace)} requests, {args.workers} workers, policy {args.policy}, SLO TTFT {args.ttft_slo} s "
          f"TPOT {args.tpot_slo} s, tick {args.tick} s (sweeps {time.perf_counter() - sweep_wall:.0f} s)")
    print(table(rows))
    print("\n".join(notes) + "\n", flush=True)
    return results


def prefill_over_time(res: dict, prefill: int, end_s: float) -> tuple[list[float], list[int]]:
    """The prefill workers' count through a run, from its planner's decisions (a switch moves one worker, a
    scale ``delta``)."""
    t, n = [0.0], [prefill]
    for d in res.get("planner", {}).get("decisions", []):
        step = (1 if d["role"] == "prefill" else -1) if d["kind"] == "switch" else \
            (d["delta"] if d["role"] == "prefill" else 0)
        t.append(d["t_s"])
        n.append(n[-1] + step)
    t.append(end_s)
    n.append(n[-1])
    return t, n


def draw(workloads: dict[str, dict[str, dict]], args) -> None:
    """Per workload: the TTFT CDF of every run, and the prefill workers' count over time in the planner's runs."""
    plt, fig, axes = plots.panels(2, f"{args.workers} simulated workers, {args.profile}, policy {args.policy}",
                                  rows=len(workloads))
    for k, (name, results) in enumerate(workloads.items()):
        plots.cdf(axes[2 * k], {label: r["_ttfts"] for label, r in results.items()}, f"{name}: TTFT (s)",
                  slo=args.ttft_slo, log=True)
        planned = {label: prefill_over_time(r, args.prefill, r["makespan_s"])
                   for label, r in results.items() if "planner" in r}
        plots.over_time(axes[2 * k + 1], planned, f"{name}: prefill workers (of {args.workers})", steps=True)
    plots.save(plt, fig, args.plot)


def tile(trace: list[TraceRequest], copies: int, window_s: float) -> list[TraceRequest]:
    """``copies`` interleaved copies of the first ``window_s`` seconds of ``trace``, with disjoint hash ids."""
    t0 = trace[0].arrival_s
    base = [r for r in trace if r.arrival_s - t0 < window_s]
    stride = max(h for r in trace for h in r.hash_ids) + 1
    gap = (base[-1].arrival_s - t0) / max(1, len(base) - 1)
    out = [dataclasses.replace(r, arrival_s=r.arrival_s - t0 + c * gap / copies,
                               hash_ids=tuple(h + c * stride for h in r.hash_ids))
           for c in range(copies) for r in base]
    out.sort(key=lambda r: (r.arrival_s, r.idx))
    return [dataclasses.replace(r, idx=i) for i, r in enumerate(out)]


def scale_run(trace: list[TraceRequest], args) -> None:
    copies = args.scale_copies or max(1, args.scale_workers // 8)
    tiled = tile(trace, copies, args.scale_window)
    prefill = round(args.scale_workers * args.scale_prefill_frac)
    # per-worker KV as in the 8-worker runs on the whole trace (the default, a share of the distinct blocks, would
    # shrink with a short window spread over 1,000 workers)
    kv_blocks = args.scale_kv_blocks or math.ceil(0.3 * distinct_blocks(trace) / 8)
    configs = [("fixed", {})]
    if not args.scale_fixed_only:
        configs.append(("migrate+planner", {"migration": MigrationConfig(),
                                            "planner": PlannerConfig(ttft_slo_s=args.ttft_slo,
                                                                     tpot_slo_s=args.tpot_slo)}))
    print(f"# scale: {args.scale_workers} workers ({prefill}P:{args.scale_workers - prefill}D), trace's first "
          f"{args.scale_window:.0f} s x {copies} copies = {len(tiled)} requests, policy {args.policy}, "
          f"{kv_blocks} KV blocks per worker")
    for label, kw in configs:
        timings: dict = {}
        res = simulate(tiled, args.policy, args.profile, num_workers=args.scale_workers - prefill,
                       prefill_workers=prefill, kv_capacity_blocks=kv_blocks, ttft_slo_s=args.ttft_slo,
                       tpot_slo_s=args.tpot_slo, timings=timings, tick_s=args.tick, **kw)
        n = max(1, timings["placements"])
        print(f"{label:16s} wall {timings['wall_s']:.1f} s = {timings['wall_s'] / n * 1e3:.2f} ms/request; "
              f"place_request {timings['place_s'] / n * 1e3:.3f} ms/request, views {timings['view_s'] / n * 1e3:.3f} "
              f"ms/request; slo {res['slo_attainment']:.3f} goodput {res['goodput_rps']:.1f}/s served "
              f"{res['served']} rejected {res['rejected']} makespan {res['makespan_s']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help=DEFAULT_TRACE_HELP)
    p.add_argument("--speeds", default="2,4", help="arrival-rate multipliers of the trace (comma list)")
    p.add_argument("--workers", type=int, default=8, help="total workers (prefill + decode)")
    p.add_argument("--prefill", type=int, default=4, help="prefill workers of the configured split")
    p.add_argument("--policy", default="kv_cost")
    p.add_argument("--profile", default="llama70b-h200")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tpot-slo", type=float, default=0.05)
    p.add_argument("--tick", type=float, default=1.0, help="simulated seconds between policy evaluations")
    p.add_argument("--skip-shifting", action="store_true")
    p.add_argument("--skip-scale", action="store_true")
    p.add_argument("--scale-workers", type=int, default=1000)
    p.add_argument("--scale-prefill-frac", type=float, default=0.75, help="prefill share of the scale run's workers")
    p.add_argument("--scale-copies", type=int, default=0, help="trace copies (0: scale-workers / 8)")
    p.add_argument("--scale-window", type=float, default=30.0, help="seconds of the trace to tile (bigger: longer)")
    p.add_argument("--scale-kv-blocks", type=int, default=0,
                   help="KV blocks per worker in the scale run (0: as the 8-worker runs on the whole trace)")
    p.add_argument("--scale-fixed-only", action="store_true", help="time the scale run without migration + planner")
    p.add_argument("--plot", default="", metavar="PNG",
                   help="draw each workload's TTFT CDFs and the planner's P:D split over time here (matplotlib)")
    args = p.parse_args(argv)
    if not 0 < args.prefill < args.workers:
        p.error("need 0 < --prefill < --workers")
    path = resolve_trace(args.trace)
    t0 = time.perf_counter()
    workloads = {}
    for speed in [float(s) for s in args.speeds.split(",") if s.strip()]:
        workloads[f"trace {speed:g}x"] = compare(f"Mooncake trace at {speed:g}x", load_trace(path, speed=speed),
                                                 args)
    if not args.skip_shifting:
        workloads["shifting"] = compare("shifting workload (chat 120 s, agent 120 s, chat 120 s)",
                                        shifting_workload(), args)
    if args.plot and workloads:
        plots.plot_or_exit(lambda: draw(workloads, args))
    if not args.skip_scale:
        scale_run(load_trace(path), args)
    print(f"# total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
