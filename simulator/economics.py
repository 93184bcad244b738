"""The money side of a simulated run: what the served tokens earn at the deployment's prices, what the GPU-hours
cost to rent, and the margin (the seed's published economics: a cache hit priced at 1/50 of a miss, revenue per
GPU-hour against the rent).

Prices (``shared.accounting.Prices``) are per million tokens in any currency; ``currency_per_usd`` converts them
(7.2 for prices in yuan, 1 for dollars). Invariants of ``summary``: ``revenue_usd == Σ price × tokens / 1e6 /
currency_per_usd`` over the cached, uncached and output tokens of the ledger's total; ``gpu_cost_usd ==
gpu_hours × gpu_hour_usd``; ``margin_usd == revenue_usd - gpu_cost_usd``; per-GPU-hour figures divide by
``gpu_hours`` (0 when there are none).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shared.accounting import Prices, UsageLine


@dataclass(frozen=True, slots=True)
class Economics:
    gpu_hour_usd: float = 2.0   # rent of one GPU for an hour (the seed assumed $2 for an H800)
    currency_per_usd: float = 1.0   # units of the prices' currency per US dollar

    def __post_init__(self) -> None:
        for name in ("gpu_hour_usd", "currency_per_usd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (name == "currency_per_usd" and value == 0):
                raise ValueError(f"{name} must be a finite number ≥ 0 (> 0 for a rate), got {value!r}")

    def summary(self, total: UsageLine, prices: Prices, gpu_hours: float) -> dict:
        """Revenue, rent and margin of a run whose served tokens are ``total`` (see the module docstring)."""
        revenue = prices.cost(total.cached_tokens, total.uncached_tokens, total.output_tokens) / self.currency_per_usd
        cost = gpu_hours * self.gpu_hour_usd
        tokens = total.prompt_tokens + total.output_tokens
        per_hour = (lambda x: round(x / gpu_hours, 6) if gpu_hours else 0.0)  # noqa: E731
        return {"revenue_usd": round(revenue, 6), "gpu_cost_usd": round(cost, 6),
                "margin_usd": round(revenue - cost, 6), "revenue_per_gpu_hour_usd": per_hour(revenue),
                "margin_per_gpu_hour_usd": per_hour(revenue - cost),
                "cost_profit_margin": round((revenue - cost) / cost, 6) if cost else None,
                "usd_per_mtok_served": round(revenue / tokens * 1e6, 6) if tokens else 0.0,
                "miss_over_hit_price": round(prices.uncached_per_mtok / prices.cached_per_mtok, 3)
                if prices.cached_per_mtok else None}
