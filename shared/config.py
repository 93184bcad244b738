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
    worker_id: str = ""
    model: str = ""  # GGUF file or HF folder; "" = default SmolLM2
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 0  # 0 = all CPUs this process may use
    kv_cache_mb: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    transports: str = "cuda_ipc,shm,nixl,stream"  # offered (when available here), in preference order
    heartbeat_s: float = 1.0
    handoff_timeout_s: float = 30.0
    drain_grace_s: float = 20.0  # on SIGTERM: how long in-flight requests may finish before being handed back

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if self.kv_cache_mb <= 0 or self.threads < 0 or self.heartbeat_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("kv_cache_mb and heartbeat_s must be positive, threads and drain_grace_s >= 0")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    worker_id: str = ""
    model: str = ""  # for the tokenizer; must be the workers' model
    local_prefill_threshold: int = 64  # prompts up to this many tokens prefill on the decode worker
    worker_dead_after_s: float = 3.0  # no heartbeat for this long = dead
    dispatch_timeout_s: float = 5.0  # a worker must accept a request within this
    stall_probe_s: float = 2.0  # a stream silent this long: ask its workers whether they still hold it
    max_failovers: int = 2  # re-placements of a request whose worker died (prompt + delivered tokens)
    max_inflight: int = 256  # admission: more concurrent requests than this are rejected (overloaded)
    policy: str = "predictive"  # round_robin | least_loaded | cache_aware | kv_cost | predictive
    ttft_slo_s: float = 0.0  # > 0: reject (overloaded) requests whose predicted TTFT exceeds it
    profile: str = "smollm2-cpu"  # step-time model the policies predict with (shared/sched/profiles.py)
    block_size: int = 16  # the workers' KV block size (tokens), for the profile's per-block transfer time
    drain_grace_s: float = 20.0  # on SIGTERM: how long relayed streams may finish before being cancelled

    def __post_init__(self) -> None:
        from shared.sched.policies import POLICIES
        from shared.sched.profiles import PROFILES

        if not self.worker_id:
            object.__setattr__(self, "worker_id", f"router-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if (self.local_prefill_threshold < 0 or self.worker_dead_after_s <= 0 or self.max_inflight <= 0
                or self.block_size <= 0 or self.max_failovers < 0 or self.drain_grace_s < 0
                or self.ttft_slo_s < 0 or self.stall_probe_s <= 0):
            raise ValueError("invalid router config")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {self.profile!r}")


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
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                            type=(lambda s, k=kinds[f.name]: _parse(k, s)))
    args = parser.parse_args(argv or [])
    values.update({k: v for k, v in vars(args).items() if v is not None})
    values.update(overrides)
    return cls(**values)
