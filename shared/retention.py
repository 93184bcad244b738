"""Retention classes: how long a block is kept after its last use, and the per-block metadata they drive.

A request carries a retention class; the deployment maps each class to a time-to-live in seconds
(default: ``chat`` 7 days, ``agent`` 3 days, ``none`` 0).

Rules (one ``BlockMeta`` per stored block):
- Expiry of a new block: ``now + ttl(class)``. A later hit or put of the same block by a request of class ``c``
  extends it: ``expiry = max(expiry, now + ttl(c))``; the block takes class ``c`` when that raised the expiry.
  So expiry never moves backwards and a ``none`` request never shortens a ``chat`` block's life.
- A class with ttl 0 (``none``) is *DRAM-only*: ``expiry == 0.0`` means "no time-based retention". Such a
  block lives in DRAM until LRU pressure evicts it; it is then dropped, never written to SSD; GC by time
  never removes it. A later hit by a class with ttl > 0 turns it into a normal, SSD-eligible block.
- A block with ``0 < expiry <= now`` is expired: it is never served and GC removes it from every tier.
- Under capacity pressure the SSD evicts in ``(expiry, last_use)`` order: soonest expiry first, least
  recently used first among equal expiries (``eviction_key``).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from shared.errors import invalid

DAY_S = 86_400.0
NO_RETENTION = "none"            # the class of a block no request class asked to keep (DRAM-only)
DEFAULT_TTL_S: Mapping[str, float] = MappingProxyType({"chat": 7 * DAY_S, "agent": 3 * DAY_S, NO_RETENTION: 0.0})
# The deployment's classes as router and cache tier read them (``retention`` in both configs, one env var
# DEEPINFER_RETENTION): both parse the same spec, so a class the router accepts is one the tier stores.
DEFAULT_SPEC = "chat=7d,agent=3d,none=0"
MAX_CLASS_NAME = 16              # fixed-width field in SSD record headers
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S}
_NAME = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_CLASS_NAME}}}")
_SPEC_ITEM = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*=\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$")


def shortest_durable(ttl_s: Mapping[str, float]) -> str:
    """The class with the shortest ttl > 0 (ties: the first name), else ``none``: the default of requests that say
    nothing and come from no chat (``agent`` in the default spec)."""
    durable = sorted((ttl, name) for name, ttl in ttl_s.items() if ttl > 0)
    return durable[0][1] if durable else NO_RETENTION


@dataclass(slots=True)
class BlockMeta:
    """Retention state of one stored block. ``expiry == 0.0``: DRAM-only (see module docstring)."""

    retention: str
    expiry: float
    last_use: float

    def is_expired(self, now: float) -> bool:
        return 0.0 < self.expiry <= now

    @property
    def is_durable(self) -> bool:
        """Whether the block may be written to SSD (its class has a ttl > 0)."""
        return self.expiry > 0.0

    def eviction_key(self) -> tuple[float, float]:
        return (self.expiry, self.last_use)

    def merge(self, other: BlockMeta) -> None:
        """Fold ``other`` in: later expiry (and its class) and later last use win."""
        if other.expiry > self.expiry:
            self.expiry, self.retention = other.expiry, other.retention
        self.last_use = max(self.last_use, other.last_use)

    def copy(self) -> BlockMeta:
        return BlockMeta(self.retention, self.expiry, self.last_use)


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Class name -> ttl seconds for one deployment. Invariant: names are short ASCII, ttls finite and ≥ 0."""

    ttl_s: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TTL_S)

    def __post_init__(self) -> None:
        if not isinstance(self.ttl_s, Mapping) or not self.ttl_s:
            raise invalid("retention policy needs at least one class")
        clean: dict[str, float] = {}
        for name, ttl in self.ttl_s.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise invalid(f"retention class names are 1..{MAX_CLASS_NAME} of [A-Za-z0-9_.-], got {name!r:.80}")
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl < 0:
                raise invalid(f"ttl of retention class {name!r} must be finite seconds ≥ 0, got {ttl!r}")
            clean[name] = float(ttl)
        object.__setattr__(self, "ttl_s", MappingProxyType(clean))

    @classmethod
    def from_spec(cls, spec: str) -> RetentionPolicy:
        """Parse ``"chat=7d,agent=3d,none=0"`` (units s, m, h, d; none = seconds), e.g. from a deployment env."""
        ttl: dict[str, float] = {}
        for item in spec.split(","):
            m = _SPEC_ITEM.match(item)
            if not m:
                raise invalid(f"bad retention spec item {item!r:.80} (want name=<number>[s|m|h|d])")
            ttl[m.group(1)] = float(m.group(2)) * _UNITS[m.group(3)]
        return cls(ttl)

    def ttl(self, retention: object) -> float:
        """The class's ttl in seconds, or ``invalid_request`` for an unknown class."""
        if not isinstance(retention, str) or retention not in self.ttl_s:
            raise invalid(f"unknown retention class {retention!r:.80} (known: {sorted(self.ttl_s)})")
        return self.ttl_s[retention]

    def new_meta(self, retention: str, now: float) -> BlockMeta:
        """Metadata of a block first stored (or hit) now by a request of class ``retention``."""
        ttl = self.ttl(retention)
        return BlockMeta(retention, now + ttl if ttl > 0 else 0.0, now)

    def extend(self, meta: BlockMeta, retention: str, now: float) -> None:
        """A request of class ``retention`` used the block now: ``expiry = max(expiry, now + ttl)``."""
        meta.merge(self.new_meta(retention, now))
