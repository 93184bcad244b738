"""The base of every service's config (``ServiceConfig``: NATS connection and identity) and how a config is
built: from environment (``DEEPINFER_<FIELD>``) then CLI flags. Each service's own config lives in its package
(``services/<name>/config.py``).

Precedence: CLI flag > environment > default. Every config is validated on construction and logged once at
start-up by its service.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """The fields every service's config has: how it reaches NATS and who it is there. ``worker_id`` ""
    becomes ``<ID_PREFIX>-<hostname>-<6 hex>``."""

    ID_PREFIX: ClassVar[str] = "service"

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""  # NATS credentials of this service's role ("" = no auth); see shared/nats_auth.py
    nats_password: str = dataclasses.field(default="", repr=False)
    worker_id: str = ""
    host_id: str = ""  # same-host KV transports only between equal ids ("" = derived: shared/host_identity.py)
    registry_replicas: int = 1  # replicas of the JetStream registry bucket when this service creates it (3 in a 3-node cluster)

    def __post_init__(self) -> None:
        servers = nats_servers(self.nats_url)
        if not servers or any("://" not in u for u in servers):
            raise ValueError(f"nats_url must be one or more comma-separated nats://host:port URLs, got {self.nats_url!r}")
        if not 1 <= self.registry_replicas <= 5:
            raise ValueError("registry_replicas must be 1..5 (JetStream's limit)")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self._id_prefix()}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")

    def _id_prefix(self) -> str:
        return self.ID_PREFIX


def nats_servers(url: str) -> list[str]:
    """The servers of a ``nats_url``: one URL or several separated by commas (nodes of one NATS cluster)."""
    return [u.strip() for u in url.split(",") if u.strip()]


# Flags that may also be spelled another way on the command line (the vocabulary ``deepinfer up``/``node`` use).
# A worker's ``--tier <id>`` names the tier it uses, as ``deepinfer node --tier`` does (``--cache-tier N`` counts the
# tiers ``up``/``node`` start; a worker's ``--cache-tier <id>`` is the older spelling, still accepted).
FLAG_ALIASES = {"nats_url": ("--nats",), "cache_tier": ("--tier",)}


def _parse(kind: type, text: str) -> Any:
    if kind is bool:
        return text.lower() in ("1", "true", "yes", "on")
    return kind(text)


def load_config(cls: type[T], argv: list[str] | None = None, **overrides: Any) -> T:
    """Defaults ← ``DEEPINFER_*`` env ← ``--flag`` args ← ``overrides``."""
    values: dict[str, Any] = {}
    fields = dataclasses.fields(cls)
    kinds = {f.name: type(f.default) for f in fields}
    for f in fields:
        env = os.environ.get(f"DEEPINFER_{f.name.upper()}")
        if env is not None:
            values[f.name] = _parse(kinds[f.name], env)
    parser = argparse.ArgumentParser(prog=cls.__name__)
    for f in fields:
        parser.add_argument(f"--{f.name.replace('_', '-')}", *FLAG_ALIASES.get(f.name, ()), dest=f.name, default=None,
                            type=(lambda s, k=kinds[f.name]: _parse(k, s)))
    args = parser.parse_args(argv or [])
    values.update({k: v for k, v in vars(args).items() if v is not None})
    values.update(overrides)
    return cls(**values)
