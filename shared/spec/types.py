"""The drafter interface: ``propose(sequences, k) -> proposals`` with per-token confidence features.

Invariants:
- Proposals are deterministic given the sequence's tokens (a drafter proposes its argmax / its match, never a
  sample), so the engine's acceptance rule treats the proposal distribution as a point mass: accept drafted
  token ``x`` with probability ``p(x)`` under the target, on rejection sample from ``p`` with ``x`` removed. That
  keeps sampled output distributed exactly as the target's, and greedy output token-for-token the target's.
- ``len(proposal.tokens) == len(proposal.features) <= k``; an empty proposal means "decode normally".
- Features of token ``i`` depend only on the sequence and tokens ``< i`` of the proposal.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TokenFeatures:
    """What a drafter knows about one drafted token (the confidence head's input)."""
    top1_prob: float = 1.0      # the drafter's probability of this token (1.0 for an n-gram match)
    entropy: float = 0.0        # entropy (nats) of the drafter's distribution at this position (0 for n-gram)
    ngram_len: int = 0          # length of the n-gram match that produced it (0 for a model drafter)
    position: int = 0           # index within the proposal, 0-based

    def as_list(self) -> list[float]:
        return [self.top1_prob, self.entropy, float(self.ngram_len), float(self.position)]


FEATURE_NAMES = ("top1_prob", "entropy", "ngram_len", "position")


@dataclass(frozen=True, slots=True)
class DraftInput:
    """One sequence to draft for: its id and every token it has (prompt + output; drafters use the tail)."""
    seq_id: str
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int] = field(default_factory=list)
    features: list[TokenFeatures] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.features):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.features)} feature rows")

    def trimmed(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], self.features[:n])


class Drafter(Protocol):
    name: str

    def propose(self, sequences: Sequence[DraftInput], k: int) -> list[Proposal]:
        """One proposal of at most ``k`` tokens per sequence, in order."""
        ...
