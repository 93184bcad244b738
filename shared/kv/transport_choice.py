"""Which KV transport two parties use: the one rule for worker pairs (placement) and worker-tier transfers.

Invariant: the result is offered by both, in the sender's preference order; same-host transports (shared
memory, CUDA IPC) only when both run on one host; a forced transport is used only when it qualifies.
Pure and import-light (no torch), so the scheduler and simulator can use it.
"""
from __future__ import annotations

from collections.abc import Sequence

SAME_HOST_TRANSPORTS = ("shm", "cuda_ipc")


def common_transport(preferred: Sequence[str], other: Sequence[str], same_host: bool,
                     forced: str = "") -> str | None:
    """The first of ``preferred`` that ``other`` also offers and the hosts allow (or ``forced`` if it does)."""
    common = [t for t in preferred if t in other and (same_host or t not in SAME_HOST_TRANSPORTS)]
    if forced:
        return forced if forced in common else None
    return common[0] if common else None
