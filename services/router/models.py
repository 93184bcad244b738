"""Which model build the router serves: workers are grouped by the model fingerprint their heartbeats report
(``shared/model/fingerprint.py``), and every request runs on workers of one fingerprint only.

The router loads only its model's tokenizer (no weights: ``services/router/tokenize.py``), so it cannot compute
the fingerprint itself; it takes the one its workers report. Rules (``ServingModel.choose``):

- One fingerprint serves at a time (the *serving* one): a client's consecutive requests (a chat's turns) see one
  build and one prefix cache, instead of alternating between builds and splitting their caches.
- The serving fingerprint is kept while it has at least as many alive, non-draining decode workers as any other
  (ties keep it); otherwise the fingerprint with the most such workers takes over (ties: the smaller string,
  so every router decides alike), and the switch is logged. A rolling upgrade under one model name thus moves
  to the new build once it holds the majority of decode workers (or the old build's workers drain or die);
  workers of a non-serving build take no new work until then.
- A failover continuation stays on its stream's fingerprint (``pinned``) while that build has an alive decode
  worker, so the rest of a stream comes from the build that produced its beginning; only when none is left does
  it continue on the serving build (logged: the tokens delivered so far are the new build's prompt, its KV is
  recomputed, never mixed).

Invariant: the placer offers a policy only workers whose fingerprint is the chosen one, so a prefill/decode
pair never mixes builds; a worker whose build changed since its last heartbeat refuses the work or the
hand-off (``model_mismatch``) and the relay re-places the request.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from services.router.workers import WorkerState

logger = logging.getLogger(__name__)


class ServingModel:
    def __init__(self) -> None:
        self.fingerprint: str | None = None  # the serving fingerprint (None until a decode worker is seen)

    def choose(self, decode: Sequence[WorkerState], pinned: str | None = None, request_id: str = "") -> str:
        """The fingerprint to place a request on, given the alive, non-draining decode workers (not empty) and
        the fingerprint its stream is pinned to (a failover continuation), if any."""
        counts = Counter(s.report.model_fingerprint for s in decode)
        if not counts:
            raise ValueError("choose needs at least one decode worker")
        if pinned is not None and pinned in counts:
            return pinned
        current = self.fingerprint
        if current not in counts or counts[current] < max(counts.values()):
            chosen = min(counts, key=lambda fp: (-counts[fp], fp))
            if current is None:
                logger.info("serving model build %s (%d decode workers)", chosen or "(unnamed)", counts[chosen])
            else:
                logger.warning("serving model build %s (%d decode workers) instead of %s (%s)", chosen or "(unnamed)",
                               counts[chosen], current, f"{counts[current]} decode workers" if current in counts
                               else "no decode worker left")
            self.fingerprint = chosen
        if pinned is not None:
            logger.warning("[%s] build %s has no decode worker left: continuing on %s", request_id, pinned,
                           self.fingerprint)
        return self.fingerprint
