"""``deepinfer status``: what a running cluster reports about itself, gathered over NATS.

``collect(nc, listen_s)`` listens to heartbeats (``di.v1.*.*.load``) for ``listen_s`` to find every service, then
asks each one for its ``StatsReply`` on ``subjects.stats(service)`` (bounded wait each; a service that does not
answer is listed with its heartbeat only). ``format_status`` renders workers (role, load, KV usage, prefix-cache
hit rate), cache tiers (blocks and bytes per tier, hits, evictions, expiries), the routers' live migrations and P:D
planner decisions, and their accounting (per tenant and retention class: cached vs uncached prompt tokens, hit
rate, cost at the configured prices).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from shared import protocol, subjects

logger = logging.getLogger(__name__)


async def collect(nc, listen_s: float = 1.5, timeout_s: float = 2.0) -> dict:
    """``{"services": {id: {"load": LoadReport dict, "stats": dict | None}}}``."""
    reports: dict[str, dict] = {}

    async def on_load(msg) -> None:
        with contextlib.suppress(Exception):
            report = protocol.decode(msg.data, protocol.LoadReport)
            reports[report.worker_id] = report.to_dict()

    sub = await nc.subscribe(subjects.LOAD_ALL, cb=on_load)
    try:
        await asyncio.sleep(listen_s)
    finally:
        await sub.unsubscribe()

    async def ask(wid: str) -> dict | None:
        try:
            reply = await nc.request(subjects.stats(wid), protocol.encode(protocol.StatsRequest()), timeout=timeout_s)
            return protocol.decode(reply.data, protocol.StatsReply).stats
        except Exception as err:  # an old service, or gone meanwhile
            logger.debug("no stats from %s: %r", wid, err)
            return None

    stats = await asyncio.gather(*(ask(wid) for wid in reports))
    return {"services": {wid: {"load": reports[wid], "stats": st} for wid, st in zip(reports, stats)}}


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _elastic_lines(router_id: str, stats: dict) -> list[str]:
    """A router's live migrations and P:D planner: pressures, decision counts, the latest decisions."""
    lines = []
    moves = stats.get("migrations")
    if moves:
        lines.append(f"migrations ({router_id}): done {moves['done']}  failed {moves['failed']}  started by policy "
                     f"{moves['started_by_policy'] or '{}'}")
    plan = stats.get("planner")
    if plan:
        lines.append(f"P:D planner ({router_id}{', acting' if plan['leader'] else ', standing by'}): pressure "
                     f"prefill {plan['prefill_pressure']:.2f} decode {plan['decode_pressure']:.2f}  decisions "
                     f"{plan['decisions'] or '{}'}  failed {plan['failed']}")
        for a in plan["recent"][-5:]:
            what = f"{a['worker_id']} -> {a['role']}" if a["kind"] == "switch" else f"{a['role']} {a['delta']:+d}"
            lines.append(f"  {a['kind']:<6} {what:<28} {a['reason']:<18} (prefill {a['prefill_pressure']:.2f}, "
                         f"decode {a['decode_pressure']:.2f})")
    return lines


def format_status(status: dict) -> str:
    services = status["services"]
    if not services:
        return "no deepinfer service heartbeated (is the cluster up and the URL right?)"
    lines = ["services:"]
    for wid, s in sorted(services.items(), key=lambda kv: (kv[1]["load"]["role"], kv[0])):
        load, st = s["load"], s["stats"] or {}
        role = load["role"]
        line = f"  {wid:<24} {role:<10}"
        if role in ("prefill", "decode"):
            hit = st.get("prefix_hit_tokens", 0) / max(1, st.get("prefix_query_tokens", 0))
            line += (f" running {load['num_running']:>3}  waiting {load['num_waiting']:>3}  "
                     f"kv {load['kv_usage']:.0%} of {load['num_total_blocks']} blocks  prefix hit {hit:.0%}")
            pools = st.get("kv_pools") or []
            if len(pools) > 1:   # a sliding-window model: the KV budget's split
                line += "  pools " + ", ".join(f"{p['name']} {p['blocks'] - p['free']}/{p['blocks']} "
                                               f"({_mib(p['blocks'] * p['block_bytes'])})" for p in pools)
            tier = st.get("tier")
            if tier:
                line += (f"  tier {tier['tier']}: pulled {tier['blocks_pulled']} blocks, wrote {tier['blocks_written']}"
                         f", dropped {tier['writes_dropped']}")
        elif role == "cache_tier" and st:
            store = st["store"]
            line += (f" dram {store['dram_blocks']} blocks ({_mib(store['dram_bytes'])})  ssd {store['ssd_blocks']} "
                     f"blocks ({_mib(store['ssd_live_bytes'])} live, {_mib(store['ssd_disk_bytes'])} on disk)  hits "
                     f"dram {store['dram_hits']} ssd {store['ssd_hits']} miss {store['misses']}  evicted "
                     f"{store['dram_evictions']}/{store['ssd_evictions']}  expired "
                     f"{store['dram_expiries'] + store['ssd_expiries']}")
        if load.get("switchable"):
            line += "  (switchable)"
        if load.get("draining"):
            line += "  (draining)"
        lines.append(line)
    for wid, s in sorted(services.items()):
        lines += _elastic_lines(wid, s["stats"] or {})
    for wid, s in sorted(services.items()):
        accounting = (s["stats"] or {}).get("accounting")
        if not accounting:
            continue
        prices = accounting["prices"]
        lines.append(f"accounting ({wid}; per million prompt tokens: cached {prices['cached_per_mtok']}, "
                     f"uncached {prices['uncached_per_mtok']}):")
        rows = [(t, c, line) for t, by in accounting["by_tenant"].items() for c, line in by.items()]
        rows.append(("total", "", accounting["total"]))
        for tenant, cls, line in rows:
            lines.append(f"  {tenant:<16} {cls:<8} requests {line['requests']:>6}  cached {line['cached_tokens']:>9}"
                         f"  uncached {line['uncached_tokens']:>9}  hit {line['hit_rate']:.1%}  "
                         f"tier {sum(line['tier_tokens'].values()):>8}  cost {line['cost']:.6f} "
                         f"(without cache {line['cost_without_cache']:.6f})")
    return "\n".join(lines)
