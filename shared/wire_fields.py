"""Field rules shared by the wire messages of ``shared.protocol``: ids, token lists, worker names, subjects,
enumerations, ranges. Every rule raises ``invalid_request`` naming the field."""
from __future__ import annotations

import math

from shared import subjects
from shared.errors import invalid

MAX_ID_LEN = 256
MAX_SUBJECT_LEN = 512  # nats-server drops a connection whose PUB line exceeds 4 KiB: stay far below


# ---- shared field rules --------------------------------------------------------------------------------

def _require(cond: bool, message: str) -> None:
    if not cond:
        raise invalid(message)


def _check_id(name: str, value: str, allow_empty: bool = False) -> None:
    _require(len(value) <= MAX_ID_LEN, f"field {name!r}: longer than {MAX_ID_LEN} characters")
    _require(allow_empty or bool(value), f"field {name!r}: must not be empty")


def _check_tokens(name: str, ids: list[int], allow_empty: bool = False) -> None:
    _require(allow_empty or bool(ids), f"field {name!r}: must not be empty")
    _require(not ids or min(ids) >= 0, f"field {name!r}: token ids must be non-negative")


def _check_worker(name: str, value: str) -> None:
    try:
        subjects.validate_token(value, name)
    except ValueError as err:
        raise invalid(f"field {name!r}: {err}") from None


def _check_subject(name: str, value: str) -> None:
    _require(len(value) <= MAX_SUBJECT_LEN, f"field {name!r}: longer than {MAX_SUBJECT_LEN} characters")
    parts = value.split(".")
    _require(bool(value) and all(p and p not in ("*", ">") and not any(c.isspace() for c in p)
                                 for p in parts), f"field {name!r}: not a literal NATS subject")


def _check_one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"field {name!r}: must be one of {', '.join(allowed)}, got {value!r}")


def _check_range(name: str, value: float, lo: float, hi: float = math.inf) -> None:
    _require(lo <= value <= hi, f"field {name!r}: {value!r} not in [{lo}, {hi}]")


def _check_window_mask(value: bytes, num_blocks: int) -> None:
    """A packed run's window bitmap (``shared/kv/block_pack.py``): empty, or one bit per block."""
    from shared.kv.block_pack import check_mask  # no torch at import time: block_pack imports it
    problem = check_mask(value, num_blocks)
    _require(problem is None, f"field 'window_mask': {problem}")
