"""Where a request runs, for every policy: the one place that decides local vs remote prefill and the KV
transport, used by the router and the simulator alike.

``place_request(policy, request, view, mode, local_prefill_tokens, transport)``:

- ``mode="local"``: the policy sees only decode workers (prefill on the decode worker).
- ``mode="remote"``: a prefill worker is required; if the policy chose local prefill, the least-loaded
  prefill worker takes it; no prefill worker at all is ``unavailable``.
- ``mode="auto"``: the policy's choice, except that a policy which does not weigh the prefill site itself
  (``decides_prefill_site`` false: every load- or cache-only policy) prefills prompts of at most
  ``local_prefill_tokens`` tokens on the decode worker.
- A disaggregated pair needs a common KV transport (``choose_transport``); without one the request falls
  back to local prefill, unless the request forced remote prefill or a transport (then ``unavailable``).

Rejections are ``Reject`` values whose reason starts with ``overloaded:`` or ``unavailable:``.
"""
from __future__ import annotations

import dataclasses

from shared.kv.transport_choice import common_transport
from services.router.policy.types import ClusterView, Placement, Reject, RequestInfo, WorkerView

PREFILL_MODES = ("auto", "remote", "local")


def choose_transport(prefill: WorkerView, decode: WorkerView, forced: str = "") -> str | None:
    """The KV transport for a worker pair: the first transport both offer in the prefill worker's preference
    order (or the forced one), same-host ones only when both run on one host."""
    return common_transport(prefill.transports, decode.transports, prefill.host == decode.host, forced)


def place_request(policy, request: RequestInfo, view: ClusterView, mode: str = "auto",
                  local_prefill_tokens: int = 64, transport: str = "") -> Placement | Reject:
    """The policy's placement with the prefill site and KV transport settled (see the module docstring)."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {mode!r}")
    if mode == "local":
        view = dataclasses.replace(view, prefill=())
    elif mode == "remote" and not view.prefill:
        return Reject("unavailable: no prefill worker is alive")
    decision = policy.place(request, view)
    if isinstance(decision, Reject) or not view.decode:  # aggregated workers: nothing to hand off
        return decision
    if decision.prefill_worker is None and mode == "remote":
        chosen = min(view.prefill, key=lambda w: (w.num_waiting + w.num_running, w.worker_id))
        decision = dataclasses.replace(decision, prefill_worker=chosen.worker_id)
    elif (decision.prefill_worker is not None and mode == "auto" and not getattr(policy, "decides_prefill_site", False)
          and request.num_prompt_tokens <= local_prefill_tokens):
        decision = dataclasses.replace(decision, prefill_worker=None)
    if decision.prefill_worker is None:
        return decision
    prefill = next(w for w in view.prefill if w.worker_id == decision.prefill_worker)
    decode = next(w for w in view.decode if w.worker_id == decision.decode_worker)
    chosen_transport = choose_transport(prefill, decode, transport)
    if chosen_transport is not None:
        return dataclasses.replace(decision, transport=chosen_transport)
    if mode == "remote" or transport:
        return Reject(f"unavailable: no common KV transport ({transport or 'any'}) between "
                      f"{prefill.worker_id} and {decode.worker_id}")
    return dataclasses.replace(decision, prefill_worker=None)
