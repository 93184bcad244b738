"""Accounting ledgers: priced lines per tenant and class, bounded key count (late keys fold into _other)."""
from services.cache_tier.ledger import TierLedger
from shared.accounting import OTHER, Ledger, Prices


def test_ledger_prices_and_bounds_its_keys():
    ledger = Ledger(Prices(cached_per_mtok=0.02, uncached_per_mtok=1.0), max_keys=3)
    ledger.record("a", "chat", 1000, 600, tier_tokens={"cache_tier": 400})
    ledger.record("", "", 100, 0)
    for tenant in ("b", "c"):                        # past the bound: folded, still counted
        ledger.record(tenant, "agent", 10, 5)
    d = ledger.as_dict()
    assert set(d["by_tenant"]) == {"a", "default", OTHER}
    assert d["by_tenant"][OTHER][OTHER]["requests"] == 2 and d["total"]["requests"] == 4
    line = d["by_tenant"]["a"]["chat"]
    assert line["uncached_tokens"] == 400 and line["tier_tokens"] == {"cache_tier": 400}
    assert line["cost"] == (600 * 0.02 + 400 * 1.0) / 1e6 < line["cost_without_cache"]


def test_tier_ledger_uses_the_same_bound():
    ledger = TierLedger(max_keys=2)
    ledger.record_get("a", "chat", 3, 1, 1, 32, 100)
    ledger.record_put("b", "chat", 2, 50)
    d = ledger.as_dict()
    assert d["by_tenant"]["a"]["chat"]["blocks_missed"] == 1 and d["by_tenant"][OTHER][OTHER]["puts"] == 1
    assert d["total"]["bytes_read"] == 100 and d["total"]["bytes_written"] == 50
