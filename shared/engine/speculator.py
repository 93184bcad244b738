"""The engine's speculative-decoding driver: asks a drafter for proposals before a step, trims them with the
confidence head, and keeps the figures (acceptance rate, verified and accepted tokens per step, tokens per
target forward) plus an optional acceptance log for training the head.

Invariants:
- Only running requests in decode state (every known token but the last has KV) get proposals, only when
  their ``speculative`` flag (else the deployment default) allows it, their ``min_tokens`` are met, and at most
  ``max_batch`` requests are running (speculation turns itself down at high concurrency, where the batch
  already keeps the hardware busy); beyond that, only requests more urgent than the least urgent running one
  (``priority``: an SLO class's, ``shared/slo_classes.py``), the most urgent first, at most ``max_batch``, so
  the budget goes to the interactive class first and a batch of one priority decodes plainly.
- A proposal never runs past ``max_tokens`` or the context window: at most ``remaining - 1`` drafted tokens.
- A drafter that raises (or a remote one that times out and returns nothing) costs this step's speculation,
  never a request: the step decodes normally.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from shared.engine.request import Request, RequestStatus
from shared.spec.types import DraftInput, Drafter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    k: int = 5                 # tokens asked from the drafter per sequence and step
    max_batch: int = 8         # speculate only while at most this many requests run
    default_on: bool = True    # requests that do not say (``speculative`` None) speculate when True


@dataclass(slots=True)
class SpecCounters:
    steps: int = 0             # engine steps that verified at least one proposal
    proposals: int = 0         # sequence-steps with a non-empty proposal
    drafted: int = 0           # drafted tokens verified by the target
    accepted: int = 0          # drafted tokens accepted
    emitted: int = 0           # tokens appended by verified sequence-steps (accepted + one each)
    drafter_errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "proposals": self.proposals, "drafted": self.drafted,
                "accepted": self.accepted, "drafter_errors": self.drafter_errors,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "verified_per_proposal": self.drafted / self.proposals if self.proposals else 0.0,
                "accepted_per_proposal": self.accepted / self.proposals if self.proposals else 0.0,
                "tokens_per_forward": self.emitted / self.proposals if self.proposals else 0.0}


class Speculator:
    """``head``: anything with ``trim(proposal) -> proposal`` (``shared/spec/confidence``), None = keep all.
    ``log``: anything with ``record(features, accepted, drafter, proposal_index)``."""

    def __init__(self, drafter: Drafter, config: SpecConfig | None = None, head: Any = None,
                 log: Any = None, max_model_len: int | None = None) -> None:
        self.drafter, self.config, self.head, self.log = drafter, config or SpecConfig(), head, log
        self.max_model_len = max_model_len
        self.counters = SpecCounters()
        self.observes = callable(getattr(drafter, "observe", None))  # it reads the target's hidden states (MTP)

    def observe(self, request_id: str, start: int, rows) -> None:
        """The target's hidden states ``rows: [n, hidden]`` of ``request_id``'s positions ``start ..``, every step
        (the engine sends them only to a drafter that ``observes``)."""
        self.drafter.observe(request_id, start, rows)

    def wants(self, req: Request) -> bool:
        flag = req.params.speculative
        if not (self.config.default_on if flag is None else flag):
            return False
        if req.status != RequestStatus.RUNNING or req.num_computed_tokens != req.num_tokens - 1:
            return False
        return req.num_output_tokens >= req.params.min_tokens

    def room(self, req: Request) -> int:
        """How many drafted tokens this request may verify now."""
        left = req.params.max_tokens - req.num_output_tokens - 1
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - req.num_tokens - 1)
        return max(0, min(left, self.config.k))

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` / ``spec_features`` of the running requests that speculate this step."""
        for req in running:
            req.spec_token_ids, req.spec_features = [], []
        if not running:
            return
        pool = running
        if len(running) > self.config.max_batch:   # a crowded batch: speculation for the most urgent only
            least = max(r.params.priority for r in running)
            pool = sorted((r for r in running if r.params.priority < least), key=lambda r: r.params.priority)
            pool = pool[:self.config.max_batch]
        chosen = [r for r in pool if self.wants(r) and self.room(r) > 0]
        if not chosen:
            return
        try:
            proposals = self.drafter.propose([DraftInput(r.request_id, r.all_token_ids) for r in chosen],
                                             self.config.k)
        except Exception:  # noqa: BLE001 - a broken drafter must never fail a request
            self.counters.drafter_errors += 1
            logger.exception("drafter %s failed; decoding without speculation", getattr(self.drafter, "name", "?"))
            return
        for req, proposal in zip(chosen, proposals):
            if self.head is not None:
                proposal = self.head.trim(proposal)
            proposal = proposal.trimmed(self.room(req))
            req.spec_token_ids, req.spec_features = list(proposal.tokens), list(proposal.features)

    def verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Count one verified proposal of ``req`` (and log each verified token's features and outcome)."""
        c = self.counters
        c.proposals += 1
        c.drafted += num_drafted
        c.accepted += num_accepted
        c.emitted += num_accepted + 1
        st = req.stats
        st.num_spec_steps += 1
        st.num_drafted += num_drafted
        st.num_accepted += num_accepted
        if self.log is not None:
            name = getattr(self.drafter, "name", "?")
            for i, features in enumerate(req.spec_features[:num_drafted]):   # every token the target verified;
                self.log.record(features, int(i < num_accepted), name, c.proposals)  # after a rejection: 0

    def finished(self, request_id: str) -> None:
        """``request_id`` left this engine (finished, aborted, migrated away): a drafter that keeps per-sequence
        state (``DraftModelDrafter.release``) drops it now rather than when evicted for room."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release([request_id])

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()
