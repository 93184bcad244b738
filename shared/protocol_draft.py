"""The draft service's wire messages (``subjects.draft(model)``, queue group ``drafters``). Same codec and rules
as every message; import them from ``shared.protocol``, which re-exports them.

Sequences and proposals travel flattened (the codec has no lists of lists): ``tokens`` is every sequence's
context back to back and ``lengths`` how many belong to each, in order; a reply's ``features`` holds
``NUM_FEATURES`` floats per proposed token (``shared/spec/types.TokenFeatures.as_list`` order).
"""
from __future__ import annotations

from shared.wire_fields import check_range, require
from shared.wire_validation import MAX_MESSAGE_BYTES, WireModel, wire_field, wire_message

MAX_DRAFT_SEQUENCES = 256
MAX_DRAFT_TOKENS = 1 << 20
MAX_DRAFT_K = 16
NUM_FEATURES = 4


def _check_lengths(lengths: list[int], total: int, what: str) -> None:
    require(not lengths or min(lengths) >= 0, f"field 'lengths': must be ≥ 0")
    require(sum(lengths) == total, f"field 'lengths': sums to {sum(lengths)}, {what} holds {total}")


@wire_message(MAX_MESSAGE_BYTES)
class DraftRequest(WireModel):
    """Decode worker -> draft service: propose up to ``k`` tokens after each sequence's context."""
    k: int
    lengths: list[int] = wire_field(max_len=MAX_DRAFT_SEQUENCES)
    tokens: list[int] = wire_field(max_len=MAX_DRAFT_TOKENS)
    budget_s: float = 0.0  # how long the asker waits for the reply; the service drops it after that (0 = no limit)

    def _check(self) -> None:
        check_range("k", self.k, 1, MAX_DRAFT_K)
        check_range("budget_s", self.budget_s, 0.0, 3600.0)
        require(bool(self.lengths) and min(self.lengths) > 0, "field 'lengths': needs ≥ 1 non-empty sequence")
        _check_lengths(self.lengths, len(self.tokens), "'tokens'")
        require(min(self.tokens) >= 0 and max(self.tokens) < 1 << 32, "field 'tokens': token ids must be uint32")


@wire_message(MAX_MESSAGE_BYTES)
class DraftReply(WireModel):
    """Draft service -> decode worker: one proposal per requested sequence, in order."""
    lengths: list[int] = wire_field(max_len=MAX_DRAFT_SEQUENCES)
    tokens: list[int] = wire_field(max_len=MAX_DRAFT_SEQUENCES * MAX_DRAFT_K)
    features: list[float] = wire_field(max_len=MAX_DRAFT_SEQUENCES * MAX_DRAFT_K * NUM_FEATURES)

    def _check(self) -> None:
        require(not self.lengths or max(self.lengths) <= MAX_DRAFT_K, f"field 'lengths': at most {MAX_DRAFT_K}")
        _check_lengths(self.lengths, len(self.tokens), "'tokens'")
        require(len(self.features) == NUM_FEATURES * len(self.tokens),
                 f"field 'features': {NUM_FEATURES} per token")
        require(not self.tokens or min(self.tokens) >= 0, "field 'tokens': token ids must be ≥ 0")
