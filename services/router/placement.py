"""The router's side of scheduling: builds a ``ClusterView`` from heartbeats and the KV index, asks the
configured policy (``shared/sched/policies.py``), and turns the decision into worker states.

Request modes: ``local`` offers the policy only decode workers; ``remote`` forces a prefill worker (the
policy's, or the least-loaded one if the policy chose local prefill); ``auto`` follows the policy, except that
load-only policies still prefill prompts up to ``local_prefill_threshold`` tokens on the decode worker.
"""
from __future__ import annotations

from collections.abc import Collection

from shared.errors import DeepinferError, ErrorCode
from shared.kv.block_hash import hash_prompt_blocks
from shared.sched.policies import make_policy
from shared.sched.types import ClusterView, CostModel, Reject, RequestInfo, WorkerView
from services.router.workers import WorkerState, WorkerTable, choose_transport


def worker_view(state: WorkerState) -> WorkerView:
    r = state.report
    return WorkerView(worker_id=r.worker_id, role=r.role, num_running=r.num_running,
                      num_waiting=r.num_waiting + state.inflight,
                      queued_prefill_tokens=r.queued_prefill_tokens + state.inflight_tokens,
                      num_free_blocks=r.num_free_blocks, num_total_blocks=max(1, r.num_total_blocks),
                      block_size=max(1, r.block_size))


class Placer:
    def __init__(self, policy: str, table: WorkerTable, index, cost: CostModel, local_prefill_threshold: int,
                 ttft_slo_s: float | None) -> None:
        kwargs = {"local_prefill_tokens": local_prefill_threshold} if policy == "predictive" else {}
        self.policy = make_policy(policy, **kwargs)
        self.table, self.index, self.cost = table, index, cost
        self.threshold, self.ttft_slo_s = local_prefill_threshold, ttft_slo_s

    def place(self, request_id: str, prompt: list[int], max_tokens: int, cache_salt: str, mode: str,
              transport: str = "", exclude: Collection[str] = ()
              ) -> tuple[WorkerState | None, WorkerState, str | None]:
        """``(prefill worker or None for local prefill, decode worker, KV transport or None)``; raises
        ``unavailable`` or ``overloaded``. Workers in ``exclude`` (a failed attempt's) are avoided while a role
        has others. Without a common KV transport the pair falls back to local prefill, unless the request
        forced remote prefill or a transport (then ``unavailable``)."""
        decode = _avoid(self.table.alive("decode"), exclude)
        if not decode:
            raise DeepinferError(ErrorCode.UNAVAILABLE, "no decode worker is alive")
        prefill = [] if mode == "local" else _avoid(self.table.alive("prefill"), exclude)
        if mode == "remote" and not prefill:
            raise DeepinferError(ErrorCode.UNAVAILABLE, "no prefill worker is alive")
        first = decode[0].report
        hashes = hash_prompt_blocks(prompt, first.block_size, first.model_id, cache_salt)
        view = ClusterView(prefill=tuple(worker_view(s) for s in prefill),
                           decode=tuple(worker_view(s) for s in decode),
                           overlap=self.index.overlap(hashes), cost=self.cost)
        decision = self.policy.place(RequestInfo(request_id, len(prompt), tuple(hashes), max_tokens,
                                                 self.ttft_slo_s), view)
        if isinstance(decision, Reject):
            code = ErrorCode.OVERLOADED if decision.reason.startswith("overloaded") else ErrorCode.UNAVAILABLE
            raise DeepinferError(code, decision.reason)
        states = self.table.workers
        prefill_state = states[decision.prefill_worker] if decision.prefill_worker else None
        if mode == "remote" and prefill_state is None:
            prefill_state = self.table.pick_prefill(prefill)
        elif mode == "auto" and self.policy.name != "predictive" and len(prompt) <= self.threshold:
            prefill_state = None
        decode_state = states[decision.decode_worker]
        if prefill_state is None:
            return None, decode_state, None
        chosen = choose_transport(prefill_state.report, decode_state.report, transport)
        if chosen is None and (mode == "remote" or transport):
            raise DeepinferError(ErrorCode.UNAVAILABLE, f"no common KV transport ({transport or 'any'}) between "
                                 f"{prefill_state.report.worker_id} and {decode_state.report.worker_id}")
        return (prefill_state, decode_state, chosen) if chosen else (None, decode_state, None)


def _avoid(states: list[WorkerState], exclude: Collection[str]) -> list[WorkerState]:
    """``states`` without the excluded workers, unless that would leave none."""
    kept = [s for s in states if s.report.worker_id not in exclude]
    return kept or states
