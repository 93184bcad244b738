"""Prompt-lookup (n-gram) drafter: propose what followed the latest earlier occurrence of the sequence's tail.

For ``n`` from ``max_ngram`` down to ``min_ngram``: take the last ``n`` tokens of the sequence (its suffix
n-gram), find the most recent earlier occurrence of them that is followed by at least one token, and propose
the up to ``k`` tokens that followed it. The first ``n`` that matches wins (longest match first).

Invariants:
- Deterministic: the proposal depends only on the sequence's tokens, ``k`` and the n-gram bounds.
- An occurrence never overlaps the suffix itself from the right: it ends at index ``<= len - 2``, so at least
  one token follows it; the continuation may run into the suffix (a repeating pattern proposes its period).
- Every drafted token carries ``TokenFeatures(top1_prob=1.0, entropy=0.0, ngram_len=n, position=i)``.
- ``len(proposal.tokens) <= k``; no match (or ``k == 0``, or a sequence shorter than ``min_ngram + 1``)
  gives an empty proposal.
- Only the last ``max_context`` tokens are searched (``None``: all), bounding the cost per call.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.spec.types import DraftInput, Proposal, TokenFeatures


def find_match(tokens: np.ndarray, n: int) -> int | None:
    """Start index of the most recent occurrence of ``tokens[-n:]`` that ends before the last token, or None.

    ``tokens``: [L] int64. Vectorised: one boolean pass per n-gram element over the candidate starts.
    """
    length = len(tokens)
    num_starts = length - n  # starts j in [0, length - n - 1]: the occurrence ends at j + n - 1 <= length - 2
    if n <= 0 or num_starts <= 0:
        return None
    suffix = tokens[length - n:]
    mask = tokens[:num_starts] == suffix[0]
    for t in range(1, n):
        if not mask.any():
            return None
        mask &= tokens[t:num_starts + t] == suffix[t]
    hits = np.flatnonzero(mask)
    return int(hits[-1]) if len(hits) else None


class PromptLookupDrafter:
    """``Drafter`` that copies from the sequence itself (prompt + output); no model, no state between calls."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_context: int | None = 4096) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min={min_ngram} max={max_ngram}")
        if max_context is not None and max_context <= max_ngram:
            raise ValueError(f"max_context must exceed max_ngram, got {max_context}")
        self.max_ngram, self.min_ngram, self.max_context = max_ngram, min_ngram, max_context

    def propose_one(self, token_ids: Sequence[int], k: int) -> Proposal:
        """The proposal for one sequence (see the module invariants)."""
        if k <= 0:
            return Proposal()
        ids = token_ids[-self.max_context:] if self.max_context is not None else token_ids
        tokens = np.asarray(ids, dtype=np.int64)  # [L]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            start = find_match(tokens, n)
            if start is None:
                continue
            drafted = tokens[start + n:start + n + k].tolist()
            features = [TokenFeatures(top1_prob=1.0, entropy=0.0, ngram_len=n, position=i)
                        for i in range(len(drafted))]
            return Proposal(drafted, features)
        return Proposal()

    def propose(self, sequences: Sequence[DraftInput], k: int) -> list[Proposal]:
        """One proposal of at most ``k`` tokens per sequence, in order."""
        return [self.propose_one(seq.token_ids, k) for seq in sequences]
