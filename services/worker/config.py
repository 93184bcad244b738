"""The prefill and decode workers' config (``python -m services.prefill|decode|switchable``)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from shared.config import ServiceConfig
from shared.engine.config import DEFAULT_KV_CACHE_MB, SCHEDULING_POLICIES
from shared.kv.kv_codec import FORMATS as KV_FORMATS
from shared.spec.factory import DEFAULT_DRAFTER


@dataclass(frozen=True, slots=True)
class WorkerConfig(ServiceConfig):
    """Prefill and decode workers (``role`` tells which)."""

    role: str = "decode"
    model: str = ""  # GGUF file or HF folder; "" = default SmolLM2
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 0  # 0 = all CPUs this process may use
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB
    swa_kv_context: int = 0  # sliding-window models: split the KV budget for prompts this long (0 = engine default)
    rope_scaling: str = ""  # JSON rope_scaling replacing the model's, e.g. YaRN to extend its context ("" = keep)
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    scheduling_policy: str = "priority"  # fcfs | priority: waiting and preemption by (priority, arrival)
    transports: str = "cuda_ipc,shm,nixl,tcp,stream"  # offered (when available here), in preference order
    heartbeat_s: float = 1.0
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    handoff_timeout_s: float = 30.0
    drain_grace_s: float = 20.0  # on SIGTERM: how long in-flight requests may finish before being handed back
    cache_tier: str = ""  # id of the cache tier service to pull from and write back to ("" = none)
    tier_kv_format: str = ""  # blocks to and from the tier compressed: fp8 | int8 ("" = the model's dtype)
    tier_timeout_s: float = 2.0  # a tier pull or write-back waits at most this (then: recompute / drop)
    tier_write_queue: int = 16  # write-backs staged and waiting for the tier; more are dropped (counted)
    preempt_offer_mib: int = 0  # > 0, with a tier: preempted sequences' KV copied for it, at most this much at once
    #                             (they resume from the tier, not by recompute); 0 = preempted sequences recompute
    draft: str = ""  # speculative decoding (decode workers): "" off, "local" in-process drafter, "remote" service
    drafter: str = DEFAULT_DRAFTER  # with draft=local: prompt_lookup | self:<layers> | mtp | a smaller model's path
    spec_k: int = 5  # tokens drafted per sequence and step
    spec_max_batch: int = 8  # speculate only while at most this many sequences run
    spec_default: bool = True  # requests that do not say (``speculative`` unset) speculate
    spec_head: str = ""  # confidence head JSON ("" = the shipped head of the drafter if any, else fixed k)
    spec_log: str = ""  # append an acceptance log (JSON lines) here, for ``deepinfer spec train-head``
    draft_timeout_s: float = 0.1  # draft=remote: a step waits at most this for proposals, then decodes plainly
    router_dead_after_s: float = 5.0  # work of a router silent this long is stopped (services/worker/router_watch.py)
    switchable: bool = False  # serves prefill or decode, switching on ``ctl(<id>, "role")`` (P:D planner)

    def _id_prefix(self) -> str:
        return self.role

    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` parsed (``None`` when empty); ``ValueError`` unless it is a JSON object."""
        if not self.rope_scaling:
            return None
        try:
            value = json.loads(self.rope_scaling)
        except ValueError as err:
            raise ValueError(f"rope_scaling is not JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("rope_scaling must be a JSON object, e.g. {\"rope_type\": \"yarn\", \"factor\": 4}")
        return value

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)  # slots=True rebuilds the class: no zero-argument super()
        if self.tier_timeout_s <= 0 or self.tier_write_queue < 0 or self.router_dead_after_s <= 0 \
                or self.preempt_offer_mib < 0:
            raise ValueError("tier_timeout_s and router_dead_after_s must be positive, tier_write_queue and "
                             "preempt_offer_mib >= 0")
        if self.draft not in ("", "local", "remote") or not 1 <= self.spec_k <= 16 or self.spec_max_batch < 1 \
                or self.draft_timeout_s <= 0:
            raise ValueError("draft must be '', local or remote; spec_k in 1..16; spec_max_batch >= 1; "
                             "draft_timeout_s > 0")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.swa_kv_context < 0:
            raise ValueError("swa_kv_context must be >= 0 (0: the engine's default)")
        self.rope_scaling_dict()  # a bad --rope-scaling is refused at start, not when the model loads
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.tier_kv_format not in ("", *KV_FORMATS):
            raise ValueError(f"tier_kv_format must be '' or one of {', '.join(KV_FORMATS)}, "
                             f"got {self.tier_kv_format!r}")
        if self.kv_cache_mb <= 0 or self.threads < 0 or self.heartbeat_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("kv_cache_mb and heartbeat_s must be positive, threads and drain_grace_s >= 0")
