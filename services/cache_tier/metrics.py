"""The cache tier's metrics (``deepinfer_cache_tier_*``), every series labelled ``worker`` (the tier's id).

Read at scrape time from what the tier already keeps (``CacheTierCollector``): the store's counters and
gauges (``services/cache_tier/store/stats.py``: blocks and bytes per tier, lookups, evictions, expiries, SSD I/O,
compaction), the per (tenant, class) ledger summed over tenants into one series per retention class (tenants
never become labels), GC runs, KV-event holdings, staged gets, handler errors. The only events it records
itself are operation latencies (``op_seconds{op="put"|"get"}``).

Invariants: a store lookup is counted once as ``dram_hit``, ``ssd_hit`` or ``miss``
(``deepinfer_cache_tier_lookups_total``), so the DRAM hit rate is ``dram_hit / sum``; per class,
``get_blocks_total{result=dram_hit|ssd_hit|miss}`` sums to the blocks workers asked for. Retention classes are
the deployment's (validated before a put or get is recorded), so their label is bounded.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.metrics.common import (FAST_BUCKETS, BoundedLabel, counter, counter_by, error_counts, gauge, gauge_by,
                                   new_registry)

P = "deepinfer_cache_tier"
# StoreStats counters exposed one-to-one: field -> (metric name, help)
STORE_COUNTERS = {
    "promotions": ("promotions", "Blocks promoted from SSD to DRAM on a hit"),
    "writebacks": ("dram_writebacks", "Blocks written from DRAM to SSD (eviction or flush)"),
    "writeback_failures": ("dram_writeback_failures", "Blocks lost to an SSD write error"),
    "dropped_dram_only": ("dram_only_dropped_blocks", "Blocks of DRAM-only classes evicted (never on SSD)"),
    "ssd_checksum_failures": ("ssd_checksum_failures", "SSD records never served: bad checksum, torn, unreadable"),
    "ssd_bytes_read": ("ssd_read_bytes", "Bytes read from SSD"),
    "ssd_bytes_written": ("ssd_written_bytes", "Bytes appended to SSD (blocks, touches, compaction copies)"),
    "ssd_blocks_written": ("ssd_written_blocks", "Blocks written to SSD"),
    "ssd_compactions": ("ssd_compactions", "SSD segments compacted"),
    "ssd_bytes_reclaimed": ("ssd_reclaimed_bytes", "SSD bytes freed by compaction, net of the copies"),
    "put_conflicts": ("put_conflicts", "Puts of a held block with other bytes (the first writer's kept)"),
}


class CacheTierMetrics:
    def __init__(self, worker_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self.labels = {"worker": worker_id}
        self._op_seconds = Histogram(f"{P}_op_seconds", "Time to serve a put (fetch + store) or a get (lookup + "
                                     "staging)", ["worker", "op"], buckets=FAST_BUCKETS, registry=self.registry)
        self._op = BoundedLabel("op", cap=8)
        self._transfer_blocks = Counter(f"{P}_transfer_blocks", "Blocks moved between a worker and the tier (put: "
                                        "fetched from the worker; get: staged for it), by transport",
                                        ["worker", "op", "transport"], registry=self.registry)
        self._transport = BoundedLabel("transport", cap=8)

    def transfer(self, op: str, transport: str, num_blocks: int) -> None:
        self._transfer_blocks.labels(**self.labels, op=self._op(op), transport=self._transport(transport)).inc(
            num_blocks)

    def watch(self, service: Any) -> None:
        """Read ``service``'s store, ledger and runtime at every scrape (``CacheTierCollector``); call once."""
        self.registry.register(CacheTierCollector(service, self.labels))

    def operation(self, op: str, seconds: float) -> None:
        self._op_seconds.labels(**self.labels, op=self._op(op)).observe(max(0.0, seconds))


class CacheTierCollector(Collector):
    """Duck-typed on the service: ``store`` (``stats()``, ``config``), ``ledger`` (``lines``), ``announced``,
    ``staged_gets()``, ``_gc_runs``, ``runtime``. Yields nothing before the store is open."""

    def __init__(self, service: Any, labels: dict[str, str]) -> None:
        self.service, self.labels = service, labels

    def collect(self):
        svc, lb = self.service, self.labels
        if getattr(svc, "store", None) is None:
            return
        s, cfg = svc.store.stats(), svc.store.config
        yield gauge_by(f"{P}_blocks", "Blocks held, by tier", lb, "tier",
                       [("dram", s["dram_blocks"]), ("ssd", s["ssd_blocks"])])
        yield gauge_by(f"{P}_bytes", "Bytes held, by tier (SSD: live records)", lb, "tier",
                       [("dram", s["dram_bytes"]), ("ssd", s["ssd_live_bytes"])])
        yield gauge_by(f"{P}_capacity_bytes", "Configured capacity, by tier", lb, "tier",
                       [("dram", cfg.dram_bytes), ("ssd", cfg.ssd_bytes)])
        yield gauge(f"{P}_ssd_disk_bytes", "SSD segment file bytes (live + dead)", lb, s["ssd_disk_bytes"])
        yield gauge(f"{P}_ssd_segments", "SSD segment files", lb, s["ssd_segments"])
        yield counter_by(f"{P}_lookups", "Store lookups, by result", lb, "result",
                         [("dram_hit", s["dram_hits"]), ("ssd_hit", s["ssd_hits"]), ("miss", s["misses"])])
        yield counter_by(f"{P}_evictions", "Blocks evicted for capacity, by tier (DRAM: pushed to SSD or dropped)",
                         lb, "tier", [("dram", s["dram_evictions"]), ("ssd", s["ssd_evictions"])])
        yield counter_by(f"{P}_expiries", "Blocks dropped as expired (retention), by tier", lb, "tier",
                         [("dram", s["dram_expiries"]), ("ssd", s["ssd_expiries"])])
        yield counter_by(f"{P}_token_mismatches", "Hash matched but tokens did not (served as a miss), by tier",
                         lb, "tier", [("dram", s["dram_token_mismatches"]), ("ssd", s["ssd_token_mismatches"])])
        yield counter_by(f"{P}_identity_mismatches", "Hash and tokens matched but the digest or model build did not "
                         "(a hash collision or another build's block, served as a miss), by tier", lb, "tier",
                         [("dram", s["dram_identity_mismatches"]), ("ssd", s["ssd_identity_mismatches"])])
        for field, (name, doc) in STORE_COUNTERS.items():
            yield counter(f"{P}_{name}", doc, lb, s[field])
        yield counter(f"{P}_gc_runs", "GC rounds (expiry + compaction)", lb, getattr(svc, "_gc_runs", 0))
        yield gauge(f"{P}_announced_blocks", "Blocks published as held in KV events", lb, len(svc.announced))
        yield gauge(f"{P}_staged_gets", "Gets whose staging is still held", lb, svc.staged_gets())
        yield from ledger_metrics(lb, svc.ledger)
        rt = getattr(svc, "runtime", None)
        if rt is not None:
            yield gauge(f"{P}_inflight_operations", "Puts and gets being served", lb, rt.num_inflight)
            yield error_counts(P, lb, rt.error_counts)


def ledger_metrics(lb: dict[str, str], ledger: Any):
    """The tier ledger's lines summed over tenants, one series per retention class."""
    by_class: dict[str, dict[str, int]] = {}
    for (_tenant, retention), line in list(ledger.lines.items()):
        acc = by_class.setdefault(retention, {})
        for name, value in dataclasses.asdict(line).items():
            acc[name] = acc.get(name, 0) + value
    classes = sorted(by_class)

    def per_class(field: str) -> list[tuple[str, int]]:
        return [(c, by_class[c][field]) for c in classes]

    yield counter_by(f"{P}_puts", "Write-backs stored, by retention class", lb, "retention", per_class("puts"))
    yield counter_by(f"{P}_put_blocks", "Blocks written by puts, by retention class", lb, "retention",
                     per_class("blocks_written"))
    yield counter_by(f"{P}_put_bytes", "Bytes written by puts, by retention class", lb, "retention",
                     per_class("bytes_written"))
    yield counter_by(f"{P}_gets", "Pulls served, by retention class", lb, "retention", per_class("gets"))
    family = CounterMetricFamily(f"{P}_get_blocks", "Blocks asked for by gets, by retention class and result",
                                 labels=[*lb, "retention", "result"])
    for c in classes:
        for result, field in (("dram_hit", "blocks_hit_dram"), ("ssd_hit", "blocks_hit_ssd"),
                              ("miss", "blocks_missed")):
            family.add_metric([*lb.values(), c, result], by_class[c][field])
    yield family
    yield counter_by(f"{P}_get_bytes", "Bytes served by gets, by retention class", lb, "retention",
                     per_class("bytes_read"))
    yield counter_by(f"{P}_served_tokens", "Prompt tokens whose KV gets served, by retention class", lb,
                     "retention", per_class("tokens_served"))
