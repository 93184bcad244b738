"""What-if grids for ``deepinfer simulate --what-if``: one run per combination of tier SSD capacity, retention and
P:D ratio, each row the hit rate, GPU-hours and money of that deployment (``simulator/economics.py``).

Spec: ``"tier=0,0.1,0.5;retention=7d,3d,1d;pd=0:8,2:6"`` — ``tier``: SSD capacity as a fraction of the
workload's distinct blocks (DRAM 1/8 of it, as ``deepinfer simulate --tier-frac``); ``retention``: the ttl of
every request's class (``<number>[s|m|h|d]``; only a workload spanning more than a ttl can tell two apart);
``pd``: prefill:decode workers (``0:D`` = D aggregated workers). An axis left out keeps the run's own value.
Invariant: ``len(rows) == Π len(axis)``, in the spec's order (the last axis varies fastest); every row of one
grid shares the workload, policy, profile, per-worker KV capacity, prices and economics.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from shared.retention import RetentionPolicy
from simulator.metrics import column_table, distinct_blocks, pyplot
from simulator.simulate import simulate

AXES = ("tier", "retention", "pd")
WHAT_IF_CLASS = "what_if"   # the retention class every request of a row has (its ttl is the row's)


@dataclass(frozen=True, slots=True)
class Cell:
    tier: float       # SSD capacity as a fraction of the distinct blocks
    retention: str    # ttl spec, e.g. "3d"
    prefill: int
    decode: int

    @property
    def pd(self) -> str:
        return f"{self.prefill}:{self.decode}"


def parse_grid(spec: str, tier: float, retention: str, prefill: int, decode: int) -> list[Cell]:
    """The cells of ``spec`` (see the module docstring); an axis left out is the given value. ``ValueError`` names
    what is wrong."""
    axes: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, values = part.partition("=")
        name = name.strip()
        if name not in AXES or not values.strip():
            raise ValueError(f"what-if axis {part!r:.80}: want {' | '.join(a + '=v1,v2' for a in AXES)}")
        if name in axes:
            raise ValueError(f"what-if axis {name!r} given twice")
        axes[name] = [v.strip() for v in values.split(",") if v.strip()]
    tiers = [_fraction(v) for v in axes.get("tier", [str(tier)])]
    retentions = axes.get("retention", [retention])
    for r in retentions:
        RetentionPolicy.from_spec(f"{WHAT_IF_CLASS}={r}")   # a bad ttl raises invalid_request here
    pds = [_pd(v) for v in axes.get("pd", [f"{prefill}:{decode}"])]
    return [Cell(t, r, p, d) for t, r, (p, d) in itertools.product(tiers, retentions, pds)]


def _fraction(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"what-if tier {value!r:.40}: want a fraction ≥ 0 of the distinct blocks")
    return f


def _pd(value: str) -> tuple[int, int]:
    p, sep, d = value.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(d) == 0:
        raise ValueError(f"what-if pd {value!r:.40}: want prefill:decode workers, e.g. 2:6 (0:8 aggregated)")
    return int(p), int(d)


def what_if(trace: list, cells: list[Cell], policy: str, profile: str, **common) -> list[dict]:
    """One ``simulate`` per cell (``common``: its other arguments, e.g. ``kv_capacity_blocks``, ``prices``,
    ``economics``; not the tier, retention or worker counts); rows of the cell's knobs and results."""
    distinct = distinct_blocks(trace)
    rows = []
    for cell in cells:
        ssd = math.ceil(cell.tier * distinct)
        res = simulate(trace, policy, profile, num_workers=cell.decode, prefill_workers=cell.prefill,
                       tier_ssd_blocks=ssd, tier_dram_blocks=math.ceil(ssd / 8), retention=WHAT_IF_CLASS,
                       retention_policy=RetentionPolicy.from_spec(f"{WHAT_IF_CLASS}={cell.retention}"), **common)
        eco = res["economics"]
        rows.append({"tier": cell.tier, "tier_ssd_blocks": ssd, "retention": cell.retention, "pd": cell.pd,
                     "hit_rate": res["hit_rate"], "ttft_p90_s": res["ttft_p90_s"],
                     "slo_attainment": res["slo_attainment"], "gpu_hours": res["gpu_hours"],
                     "revenue_per_gpu_hour_usd": eco["revenue_per_gpu_hour_usd"],
                     "margin_per_gpu_hour_usd": eco["margin_per_gpu_hour_usd"],
                     "usd_per_mtok_served": eco["usd_per_mtok_served"]})
    return rows


COLUMNS = (("tier", "tier", "{:g}"), ("ssd blocks", "tier_ssd_blocks", "{}"), ("retention", "retention", "{}"),
           ("P:D", "pd", "{}"), ("hit", "hit_rate", "{:.3f}"), ("ttft p90", "ttft_p90_s", "{:.3f}"),
           ("slo", "slo_attainment", "{:.3f}"), ("GPU-h", "gpu_hours", "{:.3f}"),
           ("$/GPU-h", "revenue_per_gpu_hour_usd", "{:.3f}"), ("margin $/GPU-h", "margin_per_gpu_hour_usd", "{:.3f}"),
           ("$/Mtok", "usd_per_mtok_served", "{:.4f}"))


def format_what_if(rows: list[dict]) -> str:
    return column_table(rows, COLUMNS)


def plot_what_if(rows: list[dict], path: str) -> None:
    """Revenue per GPU-hour and hit rate against the tier's size, one line per (retention, P:D) (matplotlib)."""
    plt = pyplot()
    fig, (ax_rev, ax_hit) = plt.subplots(1, 2, figsize=(11, 4.5))
    for key in dict.fromkeys((r["retention"], r["pd"]) for r in rows):
        line = sorted((r["tier"], r["revenue_per_gpu_hour_usd"], r["hit_rate"]) for r in rows
                      if (r["retention"], r["pd"]) == key)
        label = f"retention {key[0]}, P:D {key[1]}"
        ax_rev.plot([x for x, _, _ in line], [y for _, y, _ in line], marker="o", label=label)
        ax_hit.plot([x for x, _, _ in line], [h for _, _, h in line], marker="o", label=label)
    ax_rev.set_xlabel("tier SSD capacity (fraction of distinct blocks)")
    ax_rev.set_ylabel("revenue per GPU-hour ($)")
    ax_hit.set_xlabel("tier SSD capacity (fraction of distinct blocks)")
    ax_hit.set_ylabel("prefix hit rate")
    ax_rev.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
