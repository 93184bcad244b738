"""Field rules shared by the wire messages of ``shared.protocol``: ids, token lists, worker names, subjects,
enumerations, ranges. Every rule raises ``invalid_request`` naming the field."""
from __future__ import annotations

import math

from shared import subjects
from shared.errors import invalid
from shared.model.fingerprint import FINGERPRINT_HEX, is_fingerprint

MAX_ID_LEN = 256
MAX_SUBJECT_LEN = 512  # nats-server drops a connection whose PUB line exceeds 4 KiB: stay far below


# ---- shared field rules --------------------------------------------------------------------------------

def require(cond: bool, message: str) -> None:
    if not cond:
        raise invalid(message)


def check_id(name: str, value: str, allow_empty: bool = False) -> None:
    require(len(value) <= MAX_ID_LEN, f"field {name!r}: longer than {MAX_ID_LEN} characters")
    require(allow_empty or bool(value), f"field {name!r}: must not be empty")


def check_tokens(name: str, ids: list[int], allow_empty: bool = False) -> None:
    require(allow_empty or bool(ids), f"field {name!r}: must not be empty")
    require(not ids or min(ids) >= 0, f"field {name!r}: token ids must be non-negative")


def check_worker(name: str, value: str) -> None:
    try:
        subjects.validate_token(value, name)
    except ValueError as err:
        raise invalid(f"field {name!r}: {err}") from None


def check_subject(name: str, value: str) -> None:
    require(len(value) <= MAX_SUBJECT_LEN, f"field {name!r}: longer than {MAX_SUBJECT_LEN} characters")
    parts = value.split(".")
    require(bool(value) and all(p and p not in ("*", ">") and not any(c.isspace() for c in p)
                                 for p in parts), f"field {name!r}: not a literal NATS subject")


def check_one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    require(value in allowed, f"field {name!r}: must be one of {', '.join(allowed)}, got {value!r}")


def check_range(name: str, value: float, lo: float, hi: float = math.inf) -> None:
    require(lo <= value <= hi, f"field {name!r}: {value!r} not in [{lo}, {hi}]")


def check_window_mask(value: bytes, num_blocks: int) -> None:
    """A packed run's window bitmap (``shared/kv/block_pack.py``): empty, or one bit per block."""
    from shared.kv.block_pack import check_mask  # no torch at import time: block_pack imports it
    problem = check_mask(value, num_blocks)
    require(problem is None, f"field 'window_mask': {problem}")


def check_fingerprint(name: str, value: str, allow_empty: bool = True) -> None:
    """A model build's fingerprint (``shared/model/fingerprint.py``): 32 lowercase hex chars, or "" where the
    field is optional (a sender that names no build)."""
    require((allow_empty and value == "") or is_fingerprint(value),
             f"field {name!r}: must be a model fingerprint ({FINGERPRINT_HEX} lowercase hex characters)")
