"""A service's Prometheus endpoint: aiohttp ``GET /metrics`` on ``metrics_port``, rendering one registry.

Invariants:
- Metrics never stop a service from serving: a port that cannot be bound is logged (error) and the service
  runs on without ``/metrics``; a collector that raises during a scrape answers 500 and is logged.
- ``start`` and ``stop`` are idempotent; port 0 in ``start`` means a free port (``port`` tells which after).
- A scrape runs on the service's event loop and only reads counters (no I/O, no engine command), so it costs
  the serving path a few hundred microseconds at most.
"""
from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CollectorRegistry

from shared.metrics.common import render

logger = logging.getLogger(__name__)

DEFAULT_HOST = "0.0.0.0"  # scraped from other hosts (Prometheus), like any exporter


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, name: str = "") -> None:
        self.registry, self.name = registry, name
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int, host: str = DEFAULT_HOST) -> int:
        """Serve ``/metrics`` on ``host:port``; returns the bound port (0 when it could not be bound)."""
        if self.runner is not None:
            return self.port
        app = web.Application()
        app.router.add_get("/metrics", self._scrape)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as err:
            logger.error("%s: cannot serve /metrics on %s:%d (%s); running without metrics", self.name, host,
                         port, err)
            await runner.cleanup()
            return 0
        self.runner = runner
        self.port = int(runner.addresses[0][1])
        logger.info("%s: Prometheus metrics on http://%s:%d/metrics", self.name, host, self.port)
        return self.port

    async def _scrape(self, request: web.Request) -> web.Response:
        try:
            body, content_type = render(self.registry, request.headers.get("Accept", ""))
        except Exception:  # a collector bug must not take the service down; the scrape fails visibly
            logger.exception("%s: metrics collection failed", self.name)
            return web.Response(status=500, text="metrics collection failed (see the service log)\n")
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def stop(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.cleanup()
