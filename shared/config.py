"""One frozen config dataclass per service, built from environment (``DEEPINFER_<FIELD>``) then CLI flags.

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
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Prefill and decode workers (``role`` tells which)."""

    role: str = "decode"
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""  # NATS credentials of this service's role ("" = no auth); see shared/nats_auth.py
    nats_password: str = dataclasses.field(default="", repr=False)
    worker_id: str = ""
    host_id: str = ""  # same-host KV transports only between equal ids ("" = derived: shared/host_identity.py)
    registry_replicas: int = 1  # replicas of the JetStream registry bucket when this service creates it (3 in a 3-node cluster)
    model: str = ""  # GGUF file or HF folder; "" = default SmolLM2
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 0  # 0 = all CPUs this process may use
    kv_cache_mb: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    transports: str = "cuda_ipc,shm,nixl,tcp,stream"  # offered (when available here), in preference order
    heartbeat_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    handoff_timeout_s: float = 30.0
    drain_grace_s: float = 20.0  # on SIGTERM: how long in-flight requests may finish before being handed back
    cache_tier: str = ""  # id of the cache tier service to pull from and write back to ("" = none)
    tier_timeout_s: float = 2.0  # a tier pull or write-back waits at most this (then: recompute / drop)
    tier_write_queue: int = 16  # write-backs staged and waiting for the tier; more are dropped (counted)
    draft: str = ""  # speculative decoding (decode workers): "" off, "local" in-process drafter, "remote" service
    drafter: str = "prompt_lookup"  # with draft=local: prompt_lookup | self:<layers> | a smaller model's path
    spec_k: int = 5  # tokens drafted per sequence and step
    spec_max_batch: int = 8  # speculate only while at most this many sequences run
    spec_default: bool = True  # requests that do not say (``speculative`` unset) speculate
    spec_head: str = ""  # confidence head JSON ("" = the shipped head of the drafter if any, else fixed k)
    spec_log: str = ""  # append an acceptance log (JSON lines) here, for ``deepinfer spec train-head``
    draft_timeout_s: float = 0.1  # draft=remote: a step waits at most this for proposals, then decodes plainly
    router_dead_after_s: float = 5.0  # work of a router silent this long is stopped (shared/router_watch.py)
    switchable: bool = False  # serves prefill or decode, switching on ``ctl(<id>, "role")`` (P:D planner)

    def __post_init__(self) -> None:
        _check_cluster_fields(self)
        if self.tier_timeout_s <= 0 or self.tier_write_queue < 0 or self.router_dead_after_s <= 0:
            raise ValueError("tier_timeout_s and router_dead_after_s must be positive and tier_write_queue >= 0")
        if self.draft not in ("", "local", "remote") or not 1 <= self.spec_k <= 16 or self.spec_max_batch < 1 \
                or self.draft_timeout_s <= 0:
            raise ValueError("draft must be '', local or remote; spec_k in 1..16; spec_max_batch >= 1; "
                             "draft_timeout_s > 0")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if self.kv_cache_mb <= 0 or self.threads < 0 or self.heartbeat_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("kv_cache_mb and heartbeat_s must be positive, threads and drain_grace_s >= 0")


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
class RouterConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""  # NATS credentials of this service's role ("" = no auth); see shared/nats_auth.py
    nats_password: str = dataclasses.field(default="", repr=False)
    worker_id: str = ""
    host_id: str = ""  # same-host KV transports only between equal ids ("" = derived: shared/host_identity.py)
    registry_replicas: int = 1  # replicas of the JetStream registry bucket when this service creates it (3 in a 3-node cluster)
    model: str = ""  # for the tokenizer; must be the workers' model
    served_model_name: str = ""  # the model id clients name (/v1/models); "" = from the model file (shared/model/locate.py)
    local_prefill_threshold: int = 64  # prompts up to this many tokens prefill on the decode worker
    worker_dead_after_s: float = 3.0  # no heartbeat for this long = dead
    dispatch_timeout_s: float = 5.0  # a worker must accept a request within this
    stall_probe_s: float = 2.0  # a stream silent this long: ask its workers whether they still hold it
    max_failovers: int = 2  # re-placements of a request whose worker died (prompt + delivered tokens)
    max_inflight: int = 256  # admission: more concurrent requests than this are rejected (overloaded)
    tenant_max_inflight: int = 0  # one tenant's requests here at most (beyond: overloaded); 0 = max_inflight // 2
    tenant_weights: str = ""  # fair shares of dispatch slots, "acme=2,beta=0.5" (others 1; the plain API is "")
    dispatch_window: int = 0  # requests on workers at once: 0 = the decode workers' max_num_seqs, -1 = unlimited
    policy: str = "predictive"  # round_robin | least_loaded | cache_aware | kv_cost | predictive
    ttft_slo_s: float = 0.0  # > 0: reject (overloaded) requests whose predicted TTFT exceeds it
    profile: str = "smollm2-cpu"  # step-time model the policies predict with (shared/sched/profiles.py)
    block_size: int = 16  # the workers' KV block size (tokens), for the profile's per-block transfer time
    drain_grace_s: float = 20.0  # on SIGTERM: how long relayed streams may finish before being cancelled
    retention: str = "chat=7d,agent=3d,none=0"  # the deployment's retention classes (as the cache tier's)
    chat_retention: str = "chat"  # class of a chat request (``messages``) that names none
    prompt_retention: str = "none"  # class of a raw prompt request that names none
    price_cached: float = 0.02  # per million cached prompt tokens (accounting, ``deepinfer status``)
    price_uncached: float = 1.0  # per million uncached prompt tokens
    http_host: str = "127.0.0.1"  # the OpenAI-compatible HTTP API (and /metrics) listens here
    http_port: int = 8000  # 0 = any free port (logged), -1 = no HTTP
    api_keys: str = dataclasses.field(default="", repr=False)  # "key=tenant,..." or @file: HTTP needs a key; its tenant salts the cache
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
    planner: bool = False  # the online P:D planner (shared/sched/pd_planner.py; services/router/planner.py)
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
        _check_cluster_fields(self)
        from shared.kv.store.retention import RetentionPolicy
        from shared.sched.policies import POLICIES
        from shared.sched.profiles import PROFILES

        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"router-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if (self.local_prefill_threshold < 0 or self.worker_dead_after_s <= 0 or self.max_inflight <= 0
                or self.block_size <= 0 or self.max_failovers < 0 or self.drain_grace_s < 0
                or self.ttft_slo_s < 0 or self.stall_probe_s <= 0 or not -1 <= self.http_port <= 65535
                or self.tenant_max_inflight < 0 or self.dispatch_window < -1
                or not 0 <= self.migrate_kv_low <= self.migrate_kv_high or self.migrate_cooldown_s < 0
                or self.migrate_skew_min < 0 or self.migrate_skew_ratio < 1 or self.migrate_tpot_slo_s < 0
                or self.planner_interval_s <= 0 or self.planner_scaler not in ("none", "kubernetes", "launcher")):
            raise ValueError("invalid router config")
        parse_weights(self.tenant_weights)  # raises on a bad spec
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {self.profile!r}")
        classes = RetentionPolicy.from_spec(self.retention).ttl_s
        if self.chat_retention not in classes or self.prompt_retention not in classes:
            raise ValueError(f"chat_retention and prompt_retention must be among {sorted(classes)}")


@dataclass(frozen=True, slots=True)
class CacheTierConfig:
    """The cache tier service (``services/cache_tier``): one block store (DRAM + SSD directory) per instance."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""  # NATS credentials of this service's role ("" = no auth); see shared/nats_auth.py
    nats_password: str = dataclasses.field(default="", repr=False)
    worker_id: str = ""
    host_id: str = ""  # same-host KV transports only between equal ids ("" = derived: shared/host_identity.py)
    registry_replicas: int = 1  # replicas of the JetStream registry bucket when this service creates it (3 in a 3-node cluster)
    directory: str = ""  # SSD tier directory ("" = ~/.cache/deepinfer/cache-tier/<worker_id>)
    dram_mb: int = 1024
    # fault in the DRAM budget at start (shared/kv/store/dram_reserve.py): filling DRAM then never page-faults
    reserve_dram: bool = False
    ssd_mb: int = 65536
    segment_mb: int = 64
    fsync: str = "batch"  # always | batch | never (see shared/kv/store/config.py)
    # dirty chat/agent DRAM blocks are written behind to SSD within this: a block acknowledged more than
    # write_behind_s ago survives a SIGKILL (fsync adds no delay; it decides power-loss safety) while the SSD keeps up
    write_behind_s: float = 1.0
    retention: str = "chat=7d,agent=3d,none=0"  # class=ttl list; the deployment's retention classes
    transports: str = "shm,nixl,tcp,stream"  # offered (when available here), in preference order
    heartbeat_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    gc_interval_s: float = 60.0  # GC (expiry + compaction) and KV-event removals this often
    stage_ttl_s: float = 30.0  # a get's staging is released after this even without a CacheRelease
    fetch_timeout_s: float = 10.0  # a put's KV fetch from the worker
    max_staged_mb: int = 1024  # bytes staged for gets at once; a get that does not fit is answered 0 blocks
    price_cached: float = 0.02  # per million cached prompt tokens (accounting)
    price_uncached: float = 1.0  # per million uncached prompt tokens
    drain_grace_s: float = 5.0

    def __post_init__(self) -> None:
        _check_cluster_fields(self)
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"cache-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if not self.directory:
            path = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", "cache-tier", self.worker_id)
            object.__setattr__(self, "directory", path)
        if (self.dram_mb < 0 or self.ssd_mb <= 0 or self.segment_mb <= 0 or self.heartbeat_s <= 0
                or self.gc_interval_s <= 0 or self.stage_ttl_s <= 0 or self.fetch_timeout_s <= 0
                or self.max_staged_mb <= 0 or self.drain_grace_s < 0 or not 0 < self.write_behind_s < 3600):
            raise ValueError("invalid cache tier config")


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """The draft service (``services/draft``): proposes tokens for decode workers of ``model``."""

    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str = ""  # NATS credentials of this service's role ("" = no auth); see shared/nats_auth.py
    nats_password: str = dataclasses.field(default="", repr=False)
    worker_id: str = ""
    host_id: str = ""  # same-host KV transports only between equal ids ("" = derived: shared/host_identity.py)
    registry_replicas: int = 1  # replicas of the JetStream registry bucket when this service creates it (3 in a 3-node cluster)
    model: str = ""  # the target model (GGUF file or HF folder; "" = default SmolLM2): its id names the subject
    drafter: str = "self:8"  # prompt_lookup | self:<layers> | a smaller model's path (same vocabulary)
    window: int = 128  # a model drafter attends the last window..window+stride tokens (KV kept across steps)
    dtype: str = "auto"
    threads: int = 0  # 0 = all CPUs this process may use
    heartbeat_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    drain_grace_s: float = 5.0

    def __post_init__(self) -> None:
        _check_cluster_fields(self)
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"draft-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if self.window < 1 or self.threads < 0 or self.heartbeat_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("invalid draft service config")


def nats_servers(url: str) -> list[str]:
    """The servers of a ``nats_url``: one URL or several separated by commas (nodes of one NATS cluster)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def _check_cluster_fields(config: Any) -> None:
    servers = nats_servers(config.nats_url)
    if not servers or any("://" not in u for u in servers):
        raise ValueError(f"nats_url must be one or more comma-separated nats://host:port URLs, got {config.nats_url!r}")
    if not 1 <= config.registry_replicas <= 5:
        raise ValueError("registry_replicas must be 1..5 (JetStream's limit)")


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
