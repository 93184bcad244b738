"""Field rules shared by the wire messages of ``shared.protocol``: ids, token lists, worker names, subjects,
enumerations, ranges, and the ``sampling`` dict <-> ``SamplingParams`` conversion. Every rule raises
``invalid_request`` naming the field."""
from __future__ import annotations

import math
from typing import Any

from shared import subjects
from shared.engine.sampling_params import SamplingParams
from shared.errors import invalid
from shared.wire_validation import compile_type

MAX_ID_LEN = 256


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
    parts = value.split(".")
    _require(bool(value) and all(p and p not in ("*", ">") and not any(c.isspace() for c in p)
                                 for p in parts), f"field {name!r}: not a literal NATS subject")


def _check_one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"field {name!r}: must be one of {', '.join(allowed)}, got {value!r}")


def _check_range(name: str, value: float, lo: float, hi: float = math.inf) -> None:
    _require(lo <= value <= hi, f"field {name!r}: {value!r} not in [{lo}, {hi}]")


# ---- sampling parameters as a dict ---------------------------------------------------------------------

_SAMPLING_CHECKS = {"max_tokens": compile_type(int), "temperature": compile_type(float),
                    "top_k": compile_type(int), "top_p": compile_type(float),
                    "seed": compile_type(int | None), "stop": compile_type(list[str]),
                    "stop_token_ids": compile_type(list[int]), "ignore_eos": compile_type(bool),
                    "min_tokens": compile_type(int)}


def sampling_to_dict(sp: SamplingParams) -> dict[str, Any]:
    """SamplingParams -> plain dict of every field (tuples as lists), the ``sampling`` field on the wire."""
    return {"max_tokens": sp.max_tokens, "temperature": float(sp.temperature), "top_k": sp.top_k,
            "top_p": float(sp.top_p), "seed": sp.seed, "stop": list(sp.stop),
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos, "min_tokens": sp.min_tokens}


def sampling_from_dict(d: Any) -> SamplingParams:
    """Strict inverse of ``sampling_to_dict``: unknown keys and wrong types are ``invalid_request``;
    missing keys take SamplingParams' defaults."""
    _require(isinstance(d, dict), f"field 'sampling': expected dict, got {type(d).__name__}")
    kwargs = {}
    for key, value in d.items():
        _require(key in _SAMPLING_CHECKS, f"field 'sampling': unknown key {key!r}")
        kwargs[key] = _SAMPLING_CHECKS[key](value, f"sampling.{key}")
    for key in ("stop", "stop_token_ids"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    return SamplingParams(**kwargs)
