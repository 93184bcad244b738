"""The vocabulary of scheduling: what a policy sees and what it decides.

Policies are pure and deterministic: ``place(request, view) -> Placement | Reject`` depends only on its
arguments (no clocks, no randomness except a seeded generator owned by the policy). The router builds views
from heartbeats and the KV index; the simulator builds them from its simulated cluster. Same objects, same
decisions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks (shared/kv/block_hash.py)
    max_tokens: int
    ttft_slo_s: float | None = None  # reject early when the predicted TTFT exceeds it


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker's load as last reported. ``role`` is "prefill", "decode" or "both" (aggregated)."""

    worker_id: str
    role: str
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0  # uncached prompt tokens queued or being prefilled there
    num_free_blocks: int = 0
    num_total_blocks: int = 1
    block_size: int = 16
    host: str = ""
    transports: tuple[str, ...] = ("stream",)  # KV transports offered, in preference order

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step-time model. Prefill of ``T`` uncached tokens: ``a*T^2 + b*T + c`` seconds; pulling one block
    from another tier / the cache tier: ``block_transfer_s`` (for blocks of ``block_bytes``, 0 = unknown);
    one decode step: ``decode_step_s``."""

    prefill_a: float = 0.0
    prefill_b: float = 1e-4
    prefill_c: float = 0.0
    block_transfer_s: float = 1e-4
    decode_step_s: float = 0.02
    block_bytes: int = 0

    def prefill_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything a policy may look at for one decision.

    ``overlap[worker_id]``: how many leading prompt blocks that worker holds in its device cache.
    ``remote_overlap``: how many leading blocks are available from a slower tier (host / cache tier) to any
    worker at ``cost.block_transfer_s`` per block.
    """

    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]
    overlap: Mapping[str, int] = field(default_factory=dict)
    remote_overlap: int = 0
    cost: CostModel = field(default_factory=CostModel)


@dataclass(frozen=True, slots=True)
class Placement:
    """``prefill_worker`` None means: prefill on the decode worker itself (no disaggregation); otherwise
    ``transport`` (set by ``services/router/policy/placement.place_request``) moves the KV between the two."""

    decode_worker: str
    prefill_worker: str | None
    predicted_ttft_s: float | None = None
    reason: str = ""
    transport: str | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str
    predicted_ttft_s: float | None = None
