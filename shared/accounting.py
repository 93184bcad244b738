"""Prompt-token accounting and pricing: what a cache hit saves, per tenant and retention class.

One ledger type for the router (live requests), the cache tier (its hits and bytes) and the simulator
(simulated requests), so ``deepinfer status`` and ``deepinfer simulate`` report the same quantities.

Invariants:
- A prompt token is either *cached* (its KV came from a cache: the worker's device pool or the cache tier)
  or *uncached* (computed); ``cached + uncached == prompt`` for every recorded request. ``tier_tokens`` is
  the part of ``cached`` pulled from the cache tier, split by the tier that served it (``dram`` / ``ssd``).
- Prices are per million prompt tokens; the default is the vendor's ratio, hit : miss = 0.02 : 1.
- Bounded: at most ``max_keys`` (tenant, class) lines; further keys are folded into ``OTHER`` (counted,
  never dropped), so a client inventing tenants cannot grow the ledger.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from shared.errors import invalid
from shared.retention import NO_RETENTION

OTHER = "_other"
DEFAULT_TENANT = "default"
MAX_LEDGER_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Prices:
    """Per-million-token prices of cached (hit) and uncached (miss) prompt tokens, and of output tokens."""

    cached_per_mtok: float = 0.02
    uncached_per_mtok: float = 1.0
    output_per_mtok: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cached_per_mtok", "uncached_per_mtok", "output_per_mtok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise invalid(f"price {name} must be finite and ≥ 0, got {value!r}")

    def cost(self, cached: int, uncached: int, output: int = 0) -> float:
        return (cached * self.cached_per_mtok + uncached * self.uncached_per_mtok
                + output * self.output_per_mtok) / 1e6


@dataclass(slots=True)
class UsageLine:
    """Counters of one (tenant, retention class)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    uncached_tokens: int = 0
    output_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)   # tier ("dram" / "ssd") -> tokens pulled

    def add(self, prompt: int, cached: int, output: int, tier_tokens: dict[str, int] | None) -> None:
        cached = max(0, min(cached, prompt))
        self.requests += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.uncached_tokens += prompt - cached
        self.output_tokens += output
        for tier, n in (tier_tokens or {}).items():
            self.tier_tokens[tier] = self.tier_tokens.get(tier, 0) + max(0, int(n))

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self, prices: Prices) -> dict:
        d = asdict(self)
        d["hit_rate"] = round(self.hit_rate, 6)
        d["cost"] = round(prices.cost(self.cached_tokens, self.uncached_tokens, self.output_tokens), 9)
        d["cost_without_cache"] = round(prices.cost(0, self.prompt_tokens, self.output_tokens), 9)
        return d


def bounded_line(lines: dict, tenant: str, retention: str, make, max_keys: int = MAX_LEDGER_KEYS):
    """The line of ``(tenant or DEFAULT_TENANT, retention or NO_RETENTION)`` in ``lines``, created with ``make()``; once
    ``max_keys - 1`` keys exist, new keys share the ``(OTHER, OTHER)`` line (counted, never dropped)."""
    key = (tenant or DEFAULT_TENANT, retention or NO_RETENTION)
    line = lines.get(key)
    if line is None:
        if len(lines) >= max_keys - 1:
            key = (OTHER, OTHER)
        line = lines.setdefault(key, make())
    return line


class Ledger:
    """Per (tenant, class) ``UsageLine``s plus their total. ``record`` is O(1); ``as_dict`` is the wire form."""

    def __init__(self, prices: Prices | None = None, max_keys: int = MAX_LEDGER_KEYS) -> None:
        self.prices = prices or Prices()
        self.max_keys = max_keys
        self.lines: dict[tuple[str, str], UsageLine] = {}
        self.total = UsageLine()

    def record(self, tenant: str, retention: str, prompt_tokens: int, cached_tokens: int,
               output_tokens: int = 0, tier_tokens: dict[str, int] | None = None) -> None:
        line = bounded_line(self.lines, tenant, retention, UsageLine, self.max_keys)
        line.add(prompt_tokens, cached_tokens, output_tokens, tier_tokens)
        self.total.add(prompt_tokens, cached_tokens, output_tokens, tier_tokens)

    def as_dict(self) -> dict:
        """``{"prices": ..., "total": line, "by_tenant": {tenant: {class: line}}}`` (lines with hit rate and cost)."""
        by_tenant: dict[str, dict[str, dict]] = {}
        for (tenant, retention), line in sorted(self.lines.items()):
            by_tenant.setdefault(tenant, {})[retention] = line.as_dict(self.prices)
        return {"prices": asdict(self.prices), "total": self.total.as_dict(self.prices), "by_tenant": by_tenant}
