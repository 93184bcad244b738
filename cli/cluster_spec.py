"""What ``deepinfer up`` (one host) and ``deepinfer node`` (one host's part of a multi-host cluster) start:
``ClusterSpec``, read by ``cli/launcher.Cluster``.

Invariants: auth on an external nats-server needs that server's passwords (its users are not generated here);
tenants need auth; a spec with cache tiers and no directory gets a fresh temporary one (``temp_tier_dir``), which
``Cluster.stop`` removes.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from shared import nats_auth
from shared.engine.config import DEFAULT_KV_CACHE_MB
from shared.spec.factory import DEFAULT_DRAFTER
from shared.nats_cluster import NatsClusterNode


@dataclass
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    nats_url: str = ""  # "" = start an embedded nats-server
    model: str = ""
    served_model_name: str = ""  # the router's model id for clients ("" = from the model file)
    chat_template: str = ""  # the router's --chat-template file ("" = the model's template)
    tool_call_parser: str = ""  # the router's --tool-call-parser
    allowed_origins: str = ""  # the router's --allowed-origins (CORS)
    reasoning_parser: str = ""  # the router's --reasoning-parser
    dtype: str = "auto"
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB
    swa_kv_context: int = 0  # the workers' --swa-kv-context (0 = the engine's default)
    rope_scaling: str = ""  # the workers' --rope-scaling (JSON; "" = the model's own)
    tier_kv_format: str = ""  # the workers' --tier-kv-format ("" = blocks in the model's dtype)
    scheduling_policy: str = "priority"  # the workers' --scheduling-policy
    preempt_offer_mib: int = 0  # the workers' --preempt-offer-mib (with a tier: preempted KV resumed from it)
    transports: str = "cuda_ipc,shm,nixl,tcp,stream"
    local_prefill_threshold: int = 64
    policy: str = "predictive"
    ttft_slo_s: float = 0.0  # > 0: the router rejects (overloaded) requests predicted to miss it
    extra_env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 180.0
    cache_tier: int = 1  # cache tier services (one per host by default; 0 = none)
    cache_tier_dir: str = ""  # their SSD directories live under it ("" = a fresh temporary directory)
    cache_tier_dram_mb: int = 1024
    cache_tier_reserve_dram: bool = False  # fault the DRAM budget in at start (``deepinfer up``/``node`` do)
    cache_tier_ssd_mb: int = 16384
    draft: str = ""  # speculative decoding: "" off, "local" (in the decode workers), or "<N>" draft services
    drafter: str = DEFAULT_DRAFTER  # prompt_lookup | self:<layers> | mtp (with draft local) | a smaller model's path
    http_host: str = "127.0.0.1"  # the router's OpenAI-compatible HTTP API
    api_keys: str = ""  # the router's API keys (``RouterConfig.api_keys``), passed in its environment only
    http_port: int = 0  # 0 = a free port (``Cluster.http_url`` says which), -1 = no HTTP
    metrics: bool = True  # every worker, tier and draft service serves Prometheus /metrics on a free port
    auth: bool = False  # NATS users and per-role permissions (embedded server only; see shared/nats_auth.py)
    tenants: list[str] = field(default_factory=list)  # with auth: one client user client-<tenant> each
    # One host's part of a multi-host cluster (``deepinfer node``); the defaults are the one-host case.
    router: bool = True  # run a router here
    name: str = ""  # this host's name in service ids (decode-<name>-0; "" = decode-0): unique per cluster
    nats_host: str = "127.0.0.1"  # the embedded server listens here (a cluster node: where its peers reach it)
    nats_port: int = 0  # 0 = a free port
    nats_cluster: NatsClusterNode | None = None  # the embedded server is this node of a NATS cluster
    nats_store_dir: str = ""  # the embedded server's JetStream directory ("" = a temporary one)
    log_dir: str = ""  # every service's log file goes here ("" = a fresh temporary directory)
    nats_peers: list[str] = field(default_factory=list)  # client URLs of the other nodes: services fail over there
    tier_id: str = ""  # the cache tier this host's workers use when it runs none ("" = none)
    registry_replicas: int = 1  # JetStream replicas of the registry bucket (3 in a 3-node cluster)
    passwords: dict[str, str] = field(default_factory=dict, repr=False)  # auth: every node's same; {} = fresh
    switchable: bool = False  # prefill and decode workers can switch role (``services/switchable``; P:D planner)
    planner: bool = False  # the router runs the online P:D planner (``--planner``)
    planner_max_prefill: int = 0  # > 0: the planner may ask this launcher for workers up to these counts
    planner_max_decode: int = 0

    temp_tier_dir: bool = False  # set when cache_tier_dir was created here: ``Cluster.stop`` removes it

    def __post_init__(self) -> None:
        if self.auth and self.nats_url and not self.passwords:
            raise ValueError("auth without the embedded nats-server needs that server's passwords "
                             "(its users are not ours to make)")
        if self.switchable and self.auth and (self.nats_url or self.nats_cluster is not None):
            raise ValueError("switchable workers with auth need the lone embedded nats-server (each gets its own "
                             "instance user with both roles' rights)")
        if self.switchable and max(self.planner_max_prefill, self.planner_max_decode) > 0:
            raise ValueError("the launcher scales workers of fixed roles: --planner-max-* with --switchable would "
                             "count a switched worker under the role it started in")
        if self.tenants and not self.auth:
            raise ValueError("tenants need auth=True (a tenant is a NATS user)")
        if self.drafter == "mtp" and self.draft not in ("", "local"):
            raise ValueError("--drafter mtp reads the target's hidden states: it drafts inside the decode workers "
                             "(--draft local), not in draft services")
        for tenant in self.tenants:
            nats_auth.tenant_user(tenant)  # ValueError for a name that cannot be a user
        if self.cache_tier and not self.cache_tier_dir:
            self.cache_tier_dir = tempfile.mkdtemp(prefix="deepinfer-tier-")
            self.temp_tier_dir = True

    def tier_dir(self, index: int) -> str:
        return os.path.join(self.cache_tier_dir, f"cache-{index}")
