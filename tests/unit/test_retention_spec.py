"""One retention spec: the router and the cache tier read the same default and the same env var, and the
default spec is exactly the documented classes (chat 7 days, agent 3 days, none 0)."""
from __future__ import annotations

from services.cache_tier.config import CacheTierConfig
from services.router.config import RouterConfig
from shared.config import load_config
from shared.retention import DEFAULT_SPEC, DEFAULT_TTL_S, NO_RETENTION, RetentionPolicy


def test_router_and_tier_read_one_spec(monkeypatch):
    assert RouterConfig().retention == CacheTierConfig().retention == DEFAULT_SPEC
    assert dict(RetentionPolicy.from_spec(DEFAULT_SPEC).ttl_s) == dict(DEFAULT_TTL_S)
    assert DEFAULT_TTL_S[NO_RETENTION] == 0.0
    monkeypatch.setenv("DEEPINFER_RETENTION", "chat=1d,batch=2h,none=0")
    assert load_config(RouterConfig).retention == load_config(CacheTierConfig).retention == "chat=1d,batch=2h,none=0"


def test_a_raw_prompt_defaults_to_the_shortest_durable_class():
    """Completions-style agents resend their whole context: a raw prompt that names no class is kept like the
    shortest durable class (``agent``, 3 days, by default), so it survives a restart as a chat would; a
    deployment without durable classes keeps ``none``; an explicit choice stands."""
    assert RouterConfig().prompt_retention == "agent"
    assert RouterConfig(retention="chat=1d,batch=2h,none=0").prompt_retention == "batch"
    assert RouterConfig(retention="chat=0,none=0").prompt_retention == NO_RETENTION
    assert RouterConfig(prompt_retention="none").prompt_retention == NO_RETENTION
