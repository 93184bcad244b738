"""The router's config (``python -m services.router``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.router.policy.policies import POLICIES
from services.router.policy.profiles import PROFILES
from shared.config import ServiceConfig
from shared.retention import DEFAULT_SPEC, RetentionPolicy, shortest_durable
from shared.slo_classes import SloClasses, parse_tenant_classes


def parse_weights(spec: str) -> dict[str, float]:
    """``"acme=2,beta=0.5"`` -> ``{"acme": 2.0, "beta": 0.5}`` (tenants not named weigh 1)."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = 0.0
        if not sep or not name.strip() or not 0 < weight < 1e6:
            raise ValueError(f"tenant weight {item!r}: expected <tenant>=<positive number>")
        weights[name.strip()] = weight
    return weights


@dataclass(frozen=True, slots=True)
class RouterConfig(ServiceConfig):
    ID_PREFIX = "router"
    model: str = ""  # for the tokenizer; must be the workers' model
    served_model_name: str = ""  # the model id clients name (/v1/models); "" = from the model file (shared/model/locate.py)
    local_prefill_threshold: int = 64  # prompts up to this many tokens prefill on the decode worker
    worker_dead_after_s: float = 3.0  # no heartbeat for this long = dead
    worker_wait_s: float = 3.0  # no decode worker alive but some known: a request waits this long for one (a restart, a late heartbeat)
    dispatch_timeout_s: float = 5.0  # a worker must accept a request within this
    stall_probe_s: float = 2.0  # a stream silent this long: ask its workers whether they still hold it
    max_failovers: int = 2  # re-placements of a request whose worker died (prompt + delivered tokens)
    max_refusals: int = 4  # re-placements of a request a worker refused (draining, overloaded): nothing ran there
    max_inflight: int = 256  # admission: more concurrent requests than this are rejected (overloaded)
    tenant_max_inflight: int = 0  # one tenant's requests here at most (beyond: overloaded); 0 = max_inflight // 2
    tenant_weights: str = ""  # fair shares of dispatch slots, "acme=2,beta=0.5" (others 1; the plain API is "")
    dispatch_window: int = 0  # requests on workers at once: 0 = the decode workers' max_num_seqs, -1 = unlimited
    policy: str = "predictive"  # round_robin | least_loaded | cache_aware | kv_cost | predictive
    ttft_slo_s: float = 0.0  # > 0: the default SLO class's TTFT target, if its spec sets none
    slo_classes: str = ""  # the deployment's SLO classes (shared/slo_classes.py; "" = interactive, standard, batch)
    default_slo_class: str = "standard"  # the class of a request that names none (by slo_class, tier or tenant)
    tenant_classes: str = ""  # "acme=interactive,etl=batch": a tenant's class, also the most urgent it may ask for
    profile: str = "smollm2-cpu"  # step-time model the policies predict with (services/router/policy/profiles.py)
    block_size: int = 16  # the workers' KV block size (tokens), for the profile's per-block transfer time
    drain_grace_s: float = 20.0  # on SIGTERM: how long relayed streams may finish before being cancelled
    retention: str = DEFAULT_SPEC  # the deployment's retention classes (the cache tier reads the same)
    chat_retention: str = "chat"  # class of a chat request (``messages``) that names none
    prompt_retention: str = ""  # class of a raw prompt request that names none ("": the shortest durable class)
    price_cached: float = 0.02  # per million cached prompt tokens (accounting, ``deepinfer status``)
    price_uncached: float = 1.0  # per million uncached prompt tokens
    http_host: str = "127.0.0.1"  # the OpenAI-compatible HTTP API (and /metrics) listens here
    http_port: int = 8000  # 0 = any free port (logged), -1 = no HTTP
    api_keys: str = dataclasses.field(default="", repr=False)  # "key=tenant,..." or @file: HTTP needs a key; its tenant salts the cache
    chat_template: str = ""  # a Jinja chat template file used instead of the model's own ("" = the model's)
    tool_call_parser: str = ""  # how "auto" tool calls are read from the text: hermes | llama3_json ("" = none)
    reasoning_parser: str = ""  # <think>...</think> into reasoning_content: deepseek_r1 | qwen3 ("" = none)
    allowed_origins: str = ""  # CORS for browsers: "*" or comma-separated origins; "" = no CORS headers
    user_cache_salt: bool = False  # no API keys: the OpenAI ``user`` field salts the cache (per-user prefix caches)
    migrate_on_drain: bool = True  # move the streams of a draining decode worker (live migration) instead of
    # letting them be handed back and prefilled again elsewhere
    migrate_kv_high: float = 0.9  # a decode worker this full moves a stream to one below migrate_kv_low (> 1: off)
    migrate_kv_low: float = 0.6
    migrate_cooldown_s: float = 10.0  # a stream that moved stays put this long (no ping-pong)
    migrate_skew_min: int = 4  # a decode worker this many streams above the least loaded one (and ...
    migrate_skew_ratio: float = 2.0  # ... this many times as many) moves one to it; 0 = off
    migrate_tpot_slo_s: float = 0.0  # a decode worker stepping slower than this moves a stream to one with
    # headroom (0 = off)
    migrate_for_urgent: bool = True  # a full decode worker where a more urgent stream waits to start moves a less
    # urgent one to a worker with a free seat
    planner: bool = False  # the online P:D planner (services/router/policy/pd_planner.py; services/router/planner.py)
    planner_ttft_slo_s: float = 2.0
    planner_tpot_slo_s: float = 0.1
    planner_sustain: int = 3  # evaluations (one per planner_interval_s) that must agree before a decision
    planner_interval_s: float = 1.0
    planner_cooldown_s: float = 30.0  # between two decisions
    planner_dwell_s: float = 120.0  # a worker that switched role keeps it this long
    planner_scaler: str = "none"  # where no worker can switch: none | kubernetes (Deployments) | launcher (up)
    planner_max_prefill: int = 0  # scaling bounds (0 = that role is not scaled up)
    planner_max_decode: int = 0

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)  # slots=True rebuilds the class: no zero-argument super()
        if (self.local_prefill_threshold < 0 or self.worker_dead_after_s <= 0 or self.worker_wait_s < 0 or self.max_inflight <= 0
                or self.block_size <= 0 or self.max_failovers < 0 or self.max_refusals < 0 or self.drain_grace_s < 0
                or self.ttft_slo_s < 0 or self.stall_probe_s <= 0 or not -1 <= self.http_port <= 65535
                or self.tenant_max_inflight < 0 or self.dispatch_window < -1
                or not 0 <= self.migrate_kv_low <= self.migrate_kv_high or self.migrate_cooldown_s < 0
                or self.migrate_skew_min < 0 or self.migrate_skew_ratio < 1 or self.migrate_tpot_slo_s < 0
                or self.planner_interval_s <= 0 or self.planner_scaler not in ("none", "kubernetes", "launcher")):
            raise ValueError("invalid router config")
        parse_weights(self.tenant_weights)  # raises on a bad spec
        slo = SloClasses.from_spec(self.slo_classes, self.default_slo_class)
        unknown = {c for c in parse_tenant_classes(self.tenant_classes).values() if c not in slo.classes}
        if unknown:
            raise ValueError(f"tenant_classes names unknown SLO classes {sorted(unknown)} (known: {slo.names})")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.tool_call_parser not in ("", "hermes", "llama3_json"):
            raise ValueError(f"tool_call_parser must be hermes or llama3_json, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in ("", "deepseek_r1", "qwen3"):
            raise ValueError(f"reasoning_parser must be deepseek_r1 or qwen3, got {self.reasoning_parser!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {self.profile!r}")
        classes = RetentionPolicy.from_spec(self.retention).ttl_s
        if not self.prompt_retention:   # completions-style agents resend their context: keep it across restarts
            object.__setattr__(self, "prompt_retention", shortest_durable(classes))
        if self.chat_retention not in classes or self.prompt_retention not in classes:
            raise ValueError(f"chat_retention and prompt_retention must be among {sorted(classes)}")
