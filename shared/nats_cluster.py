"""One node of a NATS cluster: its ``server_name``, route listener and the routes to the other nodes, rendered
into the node's nats-server config (``shared/nats_auth.render_server_config(cluster=...)``).

Invariants:
- Every node of one deepinfer cluster renders the same ``cluster_name``, the same users and permissions
  (``shared/nats_auth.py``) and the same route credentials; only ``server_name``, ``listen`` and ``routes``
  differ. JetStream runs clustered (a registry bucket may have 3 replicas) because every node has a
  ``server_name`` and a cluster block.
- With ``route_password`` set, a route must log in as user ``route`` with it (nodes are not joined by whoever
  can reach the route port); the routes this node dials carry those credentials. The password lives only in
  the config file, which ``EmbeddedNatsServer`` writes readable by its owner only.
"""
from __future__ import annotations

import dataclasses
import re
import urllib.parse

ROUTE_USER = "route"
DEFAULT_CLUSTER_NAME = "deepinfer"
DEFAULT_ROUTE_PORT = 6222
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclasses.dataclass(frozen=True)
class NatsClusterNode:
    """``server_name`` (unique per node), ``listen`` ("host:port" for routes), ``routes`` (``nats-route://host:port``
    or ``host:port`` of other nodes; this node's own address may be among them: nats-server skips it)."""

    server_name: str
    listen: str = f"0.0.0.0:{DEFAULT_ROUTE_PORT}"
    routes: tuple[str, ...] = ()
    cluster_name: str = DEFAULT_CLUSTER_NAME
    route_password: str = dataclasses.field(default="", repr=False)

    def __post_init__(self) -> None:
        for value, what in ((self.server_name, "server_name"), (self.cluster_name, "cluster_name")):
            if not _TOKEN.match(value):
                raise ValueError(f"{what} must be letters, digits, '_' or '-', got {value!r}")
        if self.route_password and not _TOKEN.match(self.route_password):
            raise ValueError("the route password must be letters, digits, '_' or '-'")
        object.__setattr__(self, "routes", tuple(route_url(r) for r in self.routes))

    def render(self) -> list[str]:
        """Config lines: ``server_name`` and the ``cluster`` block (routes with credentials when set)."""
        lines = [f'server_name: "{self.server_name}"', "cluster {", f'  name: "{self.cluster_name}"',
                 f'  listen: "{self.listen}"']
        if self.route_password:
            lines += ["  authorization {", f'    user: "{ROUTE_USER}"', f'    password: "{self.route_password}"',
                      "  }"]
        lines.append("  routes = [")
        lines += [f'    "{self._with_credentials(r)}"' for r in self.routes]
        return lines + ["  ]", "}"]

    def _with_credentials(self, route: str) -> str:
        if not self.route_password:
            return route
        return route.replace("nats-route://", f"nats-route://{ROUTE_USER}:{self.route_password}@", 1)


def route_url(address: str) -> str:
    """``host[:port]`` or ``nats-route://host[:port]`` -> ``nats-route://host:port`` (port 6222 by default)."""
    text = address.strip()
    if "://" not in text:
        text = "nats-route://" + text
    parts = urllib.parse.urlsplit(text)
    if parts.scheme != "nats-route" or not parts.hostname or parts.username:
        raise ValueError(f"a route is nats-route://host:port without credentials, got {address!r}")
    return f"nats-route://{_host(parts.hostname)}:{parts.port or DEFAULT_ROUTE_PORT}"


def _host(hostname: str) -> str:
    return f"[{hostname}]" if ":" in hostname else hostname
