"""Prometheus metrics for every deepinfer service.

- ``common.py``: one registry per service instance (never the global default one), buckets, bounded labels,
  rendering with content negotiation.
- ``server.py``: ``MetricsServer``, the aiohttp ``GET /metrics`` a worker, cache tier or draft service runs on
  its ``metrics_port`` (0 = off) from start-up to the end of its drain. The router serves its own
  (``services/router/metrics.py``) on its HTTP port.
- ``worker.py`` (``deepinfer_worker_*``), ``cache_tier.py`` (``deepinfer_cache_tier_*``), ``draft.py``
  (``deepinfer_draft_*``): each service's metric set. Figures a service already counts (engine load, prefix
  cache, tier client, speculative decoding, store, ledger) are read at scrape time by a custom collector;
  only events nothing else records (latencies, outcomes, hand-off bytes) are recorded as they happen.
"""
