"""``deepinfer status --watch``: the cluster's live view in the terminal (``rich``), redrawn every ``interval_s``.

Each frame is one ``cli.status.collect`` (heartbeats, then every service's stats) drawn as:
- **workers** by role: running / waiting sequences, queued prefill tokens, KV usage (a bar), engine step time,
  prefix-cache hit rate, cache-tier pulls and write-backs, draining / switchable flags;
- **routers**: requests in flight, migrations done / failed, the P:D planner's pressures and leader;
- **cache tiers**: DRAM and SSD blocks and bytes, hits by tier, evictions and expiries;
- **recent decisions**: the planners' latest switches and scale orders, with the pressures they acted on.

``render(status)`` builds one frame (a ``rich`` renderable; no I/O), ``watch(...)`` loops until interrupted or
``frames`` were drawn. Off a terminal the frames are printed one after another (``rich``'s own rule).
"""
from __future__ import annotations

import asyncio

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.status import collect

BAR_WIDTH = 12


def _bar(fraction: float) -> Text:
    filled = round(max(0.0, min(1.0, fraction)) * BAR_WIDTH)
    style = "red" if fraction > 0.9 else "yellow" if fraction > 0.7 else "green"
    return Text("█" * filled, style=style) + Text("░" * (BAR_WIDTH - filled), style="dim") + Text(f" {fraction:.0%}")


def _workers(services: dict) -> Table:
    table = Table(title="workers", expand=True)
    for name in ("id", "role", "running", "waiting", "queued tok", "KV", "step ms", "prefix hit", "tier pull/write",
                 "state"):
        table.add_column(name, justify="right" if name not in ("id", "role", "KV", "state") else "left")
    rows = [(wid, s) for wid, s in services.items() if s["load"]["role"] in ("prefill", "decode")]
    for wid, s in sorted(rows, key=lambda r: (r[1]["load"]["role"], r[0])):
        load, st = s["load"], s["stats"] or {}
        hit = st.get("prefix_hit_tokens", 0) / max(1, st.get("prefix_query_tokens", 0))
        tier = st.get("tier") or {}
        flags = [f for f, on in (("draining", load.get("draining")), ("switchable", load.get("switchable"))) if on]
        table.add_row(wid, load["role"], str(load["num_running"]), str(load["num_waiting"]),
                      str(load.get("queued_prefill_tokens", 0)), _bar(load["kv_usage"]),
                      f"{load.get('step_ms', 0.0):.1f}", f"{hit:.0%}",
                      f"{tier.get('blocks_pulled', 0)}/{tier.get('blocks_written', 0)}" if tier else "-",
                      ", ".join(flags) or "serving")
    return table


def _routers(services: dict) -> Table:
    table = Table(title="routers", expand=True)
    for name in ("id", "in flight", "migrations done/failed", "prefill pressure", "decode pressure", "planner"):
        table.add_column(name, justify="left" if name in ("id", "planner") else "right")
    for wid, s in sorted(services.items()):
        st = s["stats"] or {}
        if s["load"]["role"] != "router":
            continue
        moves, plan = st.get("migrations") or {}, st.get("planner")
        table.add_row(wid, str(st.get("in_flight", "-")), f"{moves.get('done', 0)}/{moves.get('failed', 0)}",
                      f"{plan['prefill_pressure']:.2f}" if plan else "-", f"{plan['decode_pressure']:.2f}" if plan else "-",
                      ("acting" if plan["leader"] else "standing by") if plan else "off")
    return table


def _tiers(services: dict) -> Table:
    table = Table(title="cache tiers", expand=True)
    for name in ("id", "DRAM blocks", "DRAM MiB", "SSD blocks", "SSD MiB", "hits dram/ssd/miss", "evicted", "expired"):
        table.add_column(name, justify="left" if name == "id" else "right")
    for wid, s in sorted(services.items()):
        store = (s["stats"] or {}).get("store")
        if s["load"]["role"] != "cache_tier" or not store:
            continue
        table.add_row(wid, str(store["dram_blocks"]), f"{store['dram_bytes'] / (1 << 20):.1f}",
                      str(store["ssd_blocks"]), f"{store['ssd_live_bytes'] / (1 << 20):.1f}",
                      f"{store['dram_hits']}/{store['ssd_hits']}/{store['misses']}",
                      f"{store['dram_evictions']}/{store['ssd_evictions']}",
                      str(store["dram_expiries"] + store["ssd_expiries"]))
    return table


def _decisions(services: dict) -> Table:
    table = Table(title="recent planner decisions", expand=True)
    for name in ("router", "kind", "what", "reason", "prefill p", "decode p"):
        table.add_column(name)
    for wid, s in sorted(services.items()):
        for a in ((s["stats"] or {}).get("planner") or {}).get("recent", [])[-5:]:
            what = f"{a['worker_id']} -> {a['role']}" if a["kind"] == "switch" else f"{a['role']} {a['delta']:+d}"
            table.add_row(wid, a["kind"], what, a["reason"], f"{a['prefill_pressure']:.2f}",
                          f"{a['decode_pressure']:.2f}")
    return table


def render(status: dict) -> Group:
    """One frame of ``status`` (``cli.status.collect``'s report)."""
    services = status["services"]
    if not services:
        return Group(Text("no deepinfer service heartbeated (is the cluster up and the URL right?)", style="red"))
    return Group(_workers(services), _routers(services), _tiers(services), _decisions(services))


async def watch(nc, interval_s: float = 2.0, listen_s: float = 1.0, frames: int | None = None,
                console: Console | None = None) -> int:
    """Redraw ``render(collect(nc))`` every ``interval_s`` until Ctrl-C or ``frames`` frames; returns frames drawn."""
    console = console or Console()
    drawn = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while frames is None or drawn < frames:
            live.update(render(await collect(nc, listen_s=listen_s)), refresh=True)
            drawn += 1
            if frames is None or drawn < frames:
                await asyncio.sleep(max(0.0, interval_s - listen_s))
    return drawn
