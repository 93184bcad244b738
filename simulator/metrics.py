"""Metric helpers for the cluster simulator: percentiles, the summary dict, the table and the TTFT CDF plot."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shared.accounting import DEFAULT_TENANT, Ledger, Prices

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("hit", "hit_rate", "{:.3f}"),
    ("hit no-tier", "hit_rate_no_tier", "{:.3f}"),
    ("hit/ideal", "hit_vs_ideal", "{:.2f}"),
    ("ttft p50", "ttft_p50_s", "{:.3f}"),
    ("ttft p90", "ttft_p90_s", "{:.3f}"),
    ("ttft p99", "ttft_p99_s", "{:.3f}"),
    ("tpot p50", "tpot_p50_s", "{:.4f}"),
    ("tpot p99", "tpot_p99_s", "{:.4f}"),
    ("slo", "slo_attainment", "{:.3f}"),
    ("goodput/s", "goodput_rps", "{:.3f}"),
    ("rej", "rejected", "{}"),
    ("makespan s", "makespan_s", "{:.1f}"),
    ("$/GPU-h", "revenue_per_gpu_hour", "{:.3f}"),
)


def percentiles(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p50_s": None, f"{prefix}_p90_s": None, f"{prefix}_p99_s": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {f"{prefix}_p50_s": round(float(p50), 9), f"{prefix}_p90_s": round(float(p90), 9),
            f"{prefix}_p99_s": round(float(p99), 9)}


@dataclass(frozen=True, slots=True)
class Served:
    """One served request, simulated or measured."""
    ttft_s: float | None
    tpot_s: float | None  # None with a single output token
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def served_metrics(served: Sequence[Served], requests: int, makespan_s: float, ttft_slo_s: float | None,
                   tpot_slo_s: float | None) -> dict:
    """The metric keys simulated and measured runs share. A request meets the SLOs when it has a TTFT within
    ``ttft_slo_s`` and (if it has one) a TPOT within ``tpot_slo_s``; None means no SLO. Attainment is over
    all ``requests`` (rejected and failed ones count as missed); goodput is SLO-meeting requests per second."""
    ttfts, tpots, met, cached, prompt, out = [], [], 0, 0, 0, 0
    for r in served:
        ok = r.ttft_s is not None and (ttft_slo_s is None or r.ttft_s <= ttft_slo_s)
        if r.ttft_s is not None:
            ttfts.append(r.ttft_s)
        if r.tpot_s is not None:
            tpots.append(r.tpot_s)
            ok = ok and (tpot_slo_s is None or r.tpot_s <= tpot_slo_s)
        met += ok
        cached += min(r.prompt_tokens, r.cached_tokens)
        prompt += r.prompt_tokens
        out += r.output_tokens
    res = {
        "slo_met": met, "slo_attainment": round(met / requests, 6) if requests else 0.0,
        "goodput_rps": round(met / makespan_s, 6) if makespan_s and makespan_s > 0 else 0.0,
        "makespan_s": round(makespan_s, 6), "hit_rate_tokens": round(cached / max(1, prompt), 6),
        "cached_input_tokens": cached, "uncached_input_tokens": prompt - cached, "output_tokens": out,
    }
    res.update(percentiles(ttfts, "ttft"))
    res.update(percentiles(tpots, "tpot"))
    res["_ttfts"], res["_tpots"] = ttfts, tpots  # for plot_ttft_cdf and tests; left out of json_line
    return res


def account(done, block_size: int, retention: str, prices: Prices) -> tuple[list[Served], Ledger]:
    """``Served`` rows and the accounting ledger (tenant ``default``, class ``retention``) of simulated
    requests ``done``: ``(request, end_s)`` with ``request.tr`` its trace row, ``first_s`` its first token,
    ``hit`` its cached blocks and ``tier_tokens`` what it pulled from each cache tier."""
    ledger = Ledger(prices)
    served = []
    for r, end in done:
        cached = min(r.tr.input_length, r.hit * block_size)
        served.append(Served(r.first_s - r.tr.arrival_s,
                             (end - r.first_s) / (r.tr.output_length - 1) if r.tr.output_length > 1 else None,
                             r.tr.input_length, cached, r.tr.output_length))
        ledger.record(DEFAULT_TENANT, retention, r.tr.input_length, cached, r.tr.output_length, r.tier_tokens)
    return served, ledger


def ideal_hit_rate(trace) -> float:
    """Fraction of blocks whose id appeared in an earlier request (one infinite cache)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        for h in r.hash_ids:
            total += 1
            hit += h in seen
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def distinct_blocks(trace) -> int:
    return len({h for r in trace for h in r.hash_ids})


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def format_table(results: list[dict]) -> str:
    """One row per run (policy); ideal hit rate and configuration in a header line. The ``hit no-tier``
    column appears when some run reports ``hit_rate_no_tier`` (the same run without the cache tier)."""
    if not results:
        return "(no results)"
    r0 = results[0]
    tier = f"dram {r0.get('tier_dram_blocks', 0)} + ssd {r0.get('tier_ssd_blocks', 0)} blocks"
    if r0.get("retention"):
        tier += f" ({r0['retention']})"
    head = (f"profile={r0['profile']} workers={r0['workers']} kv_blocks/worker={r0['kv_capacity_blocks']} "
            f"tier={tier} ttft_slo={r0['ttft_slo_s']}s tpot_slo={r0['tpot_slo_s']}s "
            f"speed={r0['speed']} requests={r0['requests']} ideal_hit={r0['ideal_hit_rate']:.3f}")
    columns = [c for c in TABLE_COLUMNS if c[1] != "hit_rate_no_tier"
               or any(r.get("hit_rate_no_tier") is not None for r in results)]
    return "\n".join([head, column_table(results, columns)])


def column_table(results: list[dict], columns) -> str:
    """``results`` as aligned text: one row per dict, ``columns`` of ``(title, key, format)`` (None prints "-");
    the first column left-aligned, the others right-aligned, a rule under the titles."""
    rows = [[name for name, _, _ in columns]]
    rows += [[_fmt(fmt, r.get(key)) for _, key, fmt in columns] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def json_line(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if not k.startswith("_")}, sort_keys=True)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or RuntimeError saying how to install the optional plot extra."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib, which is not installed "
                           "(make installs it; else pip install 'deepinfer[plot]')") from exc
    return plt


def plot_ttft_cdf(results: list[dict], path: str) -> None:
    """TTFT CDF per policy (needs matplotlib; the simulator keeps per-request TTFTs under ``_ttfts``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ttfts = np.sort(np.asarray(r.get("_ttfts", []), dtype=np.float64))
        if len(ttfts):
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=r["policy"])
    if results and results[0].get("ttft_slo_s"):
        ax.axvline(results[0]["ttft_slo_s"], color="grey", linestyle="--", label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of served requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
