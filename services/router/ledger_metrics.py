"""The router's scrape-time metrics read from what it already keeps: the cost ledger and live migrations.

- ``deepinfer_router_ledger_tokens_total{tenant,retention,kind}``: prompt tokens by ``kind`` ``cached`` /
  ``uncached``, and ``output`` tokens, of finished requests per (tenant, retention class) line of the router's
  ``Ledger`` (``shared/accounting.py``); ``deepinfer_router_ledger_tier_tokens_total{tenant,retention,tier}``:
  of the cached ones, those pulled from the cache tier's ``dram`` / ``ssd``; ``..._ledger_requests_total``;
  ``deepinfer_router_ledger_cost_total{tenant,retention}``: what they cost at the router's prices (currency
  units: ``price_cached`` / ``price_uncached`` per million tokens), beside ``..._ledger_cost_without_cache_total``
  (every prompt token priced as a miss) — the saving a dashboard shows is their difference.
- ``deepinfer_router_migrations_total{result}`` (``done``, ``failed``) and
  ``deepinfer_router_migrations_started_total{reason}`` (the migration policy's reasons).

Cardinality: tenant and class labels are the ledger's lines, at most ``MAX_LEDGER_KEYS`` (1,024; later pairs share one
``other`` line); reasons are the policy's fixed set. Values only grow (counters), as the ledger's do.
"""
from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

P = "deepinfer_router"


class RouterCollector(Collector):
    """``router``: a ``RouterService`` (duck-typed: ``ledger``, ``migrator``); reads at each scrape."""

    def __init__(self, router: Any) -> None:
        self.router = router

    def collect(self):
        ledger = self.router.ledger
        keys = ["tenant", "retention"]
        tokens = CounterMetricFamily(f"{P}_ledger_tokens", "Tokens of finished requests by ledger line and kind "
                                     "(cached / uncached prompt tokens, output tokens)", labels=[*keys, "kind"])
        tier = CounterMetricFamily(f"{P}_ledger_tier_tokens", "Cached prompt tokens pulled from the cache tier, "
                                   "by ledger line and tier", labels=[*keys, "tier"])
        requests = CounterMetricFamily(f"{P}_ledger_requests", "Finished requests by ledger line", labels=keys)
        cost = CounterMetricFamily(f"{P}_ledger_cost", "What the finished requests cost at the router's prices",
                                   labels=keys)
        uncached = CounterMetricFamily(f"{P}_ledger_cost_without_cache", "What they would have cost with every "
                                       "prompt token a miss", labels=keys)
        for (tenant, retention), line in sorted(ledger.lines.items()):
            at = [tenant, retention]
            for kind, n in (("cached", line.cached_tokens), ("uncached", line.uncached_tokens),
                            ("output", line.output_tokens)):
                tokens.add_metric([*at, kind], n)
            for name, n in sorted(line.tier_tokens.items()):
                tier.add_metric([*at, name], n)
            requests.add_metric(at, line.requests)
            cost.add_metric(at, ledger.prices.cost(line.cached_tokens, line.uncached_tokens, line.output_tokens))
            uncached.add_metric(at, ledger.prices.cost(0, line.prompt_tokens, line.output_tokens))
        yield from (tokens, tier, requests, cost, uncached)
        migrator = getattr(self.router, "migrator", None)
        if migrator is not None:
            moved = CounterMetricFamily(f"{P}_migrations", "Live migrations of running streams, by result",
                                        labels=["result"])
            moved.add_metric(["done"], migrator.done)
            moved.add_metric(["failed"], migrator.failed)
            started = CounterMetricFamily(f"{P}_migrations_started", "Migrations the migration policy started, by "
                                          "reason", labels=["reason"])
            for reason, n in sorted(migrator.reasons.items()):
                started.add_metric([reason], n)
            yield from (moved, started)
