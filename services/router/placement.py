"""The router's side of scheduling: picks the model build (``services/router/models.py``), builds a
``ClusterView`` of that build's workers from heartbeats and the KV index (block hashes under that build's
fingerprint), asks ``services/router/policy/placement.place_request`` (the configured policy plus the one rule for the
prefill site and KV transport, shared with the simulator), and turns the decision into worker states.

Invariant: both workers of a placement report the fingerprint it returns.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection

from shared.errors import DeepinferError, ErrorCode
from shared.kv.block_hash import hash_prompt_blocks
from services.router.policy.placement import place_request
from services.router.policy.policies import make_policy
from services.router.policy.types import ClusterView, CostModel, Reject, RequestInfo, WorkerView
from services.router.models import ServingModel
from services.router.workers import WorkerState, WorkerTable


def worker_view(state: WorkerState) -> WorkerView:
    r = state.report
    return WorkerView(worker_id=r.worker_id, role=r.role, num_running=r.num_running,
                      num_waiting=r.num_waiting + state.inflight,
                      queued_prefill_tokens=r.queued_prefill_tokens + state.inflight_tokens,
                      num_free_blocks=r.num_free_blocks, num_total_blocks=max(1, r.num_total_blocks),
                      block_size=max(1, r.block_size), host=r.host, transports=tuple(r.transports))


class Placer:
    def __init__(self, policy: str, table: WorkerTable, index, cost: CostModel, local_prefill_threshold: int) -> None:
        kwargs = {"local_prefill_tokens": local_prefill_threshold} if policy == "predictive" else {}
        self.policy = make_policy(policy, **kwargs)
        self.table, self.index, self.cost = table, index, cost
        self.threshold = local_prefill_threshold
        self.model = ServingModel()

    def place(self, request_id: str, prompt: list[int], max_tokens: int, cache_salt: str, mode: str,
              transport: str = "", exclude: Collection[str] = (), fingerprint: str | None = None,
              holders: dict[str, int] | None = None,
              ttft_slo_s: float | None = None) -> tuple[WorkerState | None, WorkerState, str | None, str]:
        """``(prefill worker or None for local prefill, decode worker, KV transport or None, model fingerprint)``;
        raises ``unavailable`` or ``overloaded``. Only workers of one build are considered: ``fingerprint`` (a
        failover continuation's) while it has a decode worker, else the serving one. Workers in ``exclude`` (a
        failed attempt's) are avoided while that build has others in their role. ``holders``: ``{worker: prompt
        tokens}`` the router knows a worker holds though its KV events have not said so yet (a sibling choice).
        ``ttft_slo_s``: the request's TTFT target (its SLO class's; None: none): a placement predicted to miss it
        is ``overloaded``."""
        alive = self.table.placeable("decode")
        if not alive:
            raise DeepinferError(ErrorCode.UNAVAILABLE, "no decode worker is alive")
        build = self.model.choose(alive, fingerprint, request_id)
        decode = _avoid([s for s in alive if s.report.model_fingerprint == build], exclude)
        prefill = [] if mode == "local" else _avoid(
            [s for s in self.table.placeable("prefill") if s.report.model_fingerprint == build], exclude)
        first = decode[0].report
        hashes = hash_prompt_blocks(prompt, first.block_size, build, cache_salt)
        overlap = self.index.overlap(hashes)
        for worker, tokens in (holders or {}).items():
            overlap[worker] = max(overlap.get(worker, 0), min(len(hashes), tokens // first.block_size))
        view = ClusterView(prefill=tuple(worker_view(s) for s in prefill),
                           decode=tuple(worker_view(s) for s in decode),
                           overlap=overlap,
                           remote_overlap=self.index.tier_overlap(hashes, "cache_tier"),
                           cost=self.tier_cost(prefill + decode))
        info = RequestInfo(request_id, len(prompt), tuple(hashes), max_tokens, ttft_slo_s)
        decision = place_request(self.policy, info, view, mode, self.threshold, transport)
        if isinstance(decision, Reject):
            code = ErrorCode.OVERLOADED if decision.reason.startswith("overloaded") else ErrorCode.UNAVAILABLE
            raise DeepinferError(code, decision.reason)
        states = self.table.workers
        prefill_state = states[decision.prefill_worker] if decision.prefill_worker else None
        return prefill_state, states[decision.decode_worker], decision.transport, build


    def tier_cost(self, workers: list[WorkerState]) -> CostModel:
        """The cost model with the cache-tier pull cost the workers measured (their mean seconds per block);
        when none has pulled yet, the profile's scaled by the bytes of the workers' blocks against the
        profile's (an MLA model's latent blocks are priced at their size, not at the profile model's)."""
        measured = [s.report.tier_block_s for s in workers if s.report.tier_block_s > 0]
        if measured:
            return dataclasses.replace(self.cost, block_transfer_s=sum(measured) / len(measured))
        sizes = [s.report.block_bytes for s in workers if s.report.block_bytes > 0]
        if not sizes or self.cost.block_bytes <= 0:
            return self.cost
        scale = sum(sizes) / len(sizes) / self.cost.block_bytes
        return dataclasses.replace(self.cost, block_transfer_s=self.cost.block_transfer_s * scale)


def _avoid(states: list[WorkerState], exclude: Collection[str]) -> list[WorkerState]:
    """``states`` without the excluded workers, unless that would leave none."""
    kept = [s for s in states if s.report.worker_id not in exclude]
    return kept or states
