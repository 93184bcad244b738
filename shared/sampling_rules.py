"""The rules every set of sampling parameters obeys, in one place: the wire message (``protocol.Sampling``)
and the engine's ``SamplingParams`` both run ``check_sampling``, so a request valid on the wire is valid in
every engine and the two can never drift apart. Violations raise ``invalid_request`` naming the field."""
from __future__ import annotations

from collections.abc import Sequence

from shared.errors import invalid

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_sampling(*, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
                   stop: Sequence[str], stop_token_ids: Sequence[int], min_tokens: int) -> None:
    if not _is_int(max_tokens) or max_tokens <= 0:
        raise invalid(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise invalid(f"min_tokens must be an integer in [0, max_tokens], got {min_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < 1e6:
        raise invalid(f"temperature must be >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k < -1:
        raise invalid(f"top_k must be -1, 0 (disabled) or a positive integer, got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise invalid(f"seed must be an integer in [0, 2^63), got {seed!r}")
    if len(stop) > MAX_STOP_STRINGS or any(
            not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN for s in stop):
        raise invalid(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                      f"{MAX_STOP_STRING_LEN} characters")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in stop_token_ids):
        raise invalid(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")
