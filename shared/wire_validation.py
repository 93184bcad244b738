"""The wire codec: one small, strict validator for wire dataclasses, driven by their field annotations, plus
the registry of message types and ``encode`` / ``decode`` (msgpack). Messages live in ``shared.protocol``.

Supported annotations: ``int``, ``float`` (an ``int`` is accepted and stored as ``float``), ``str``, ``bool``,
``bytes``, ``list[int]``, ``list[float]``, ``list[str]``, ``list[dict]``, ``list[list[int]]``,
``list[list[float]]``, ``dict`` / ``dict[str, Any]``, ``Any``, ``X | None`` / ``Optional[X]`` and nested
``WireModel`` dataclasses (given as an instance or a mapping).

Invariants enforced for every ``WireModel`` on construction (so on decode too):
- ``bool`` is never accepted where ``int`` or ``float`` is expected, and ints fit msgpack's range
  [-2**63, 2**64 - 1];
- lists hold at most ``max_len`` items (``wire_field(max_len=...)``, default ``MAX_LIST_LEN``); tuples are
  accepted and stored as lists; dict keys are ``str``;
- every failure is ``DeepinferError(INVALID_REQUEST)`` whose message names the offending field.

Codec: a message is the msgpack map ``{"v": PROTOCOL_VERSION, "type": <class name>, **fields}``. ``decode``
raises only ``DeepinferError`` (``invalid_request``, ``unsupported_version``, ``payload_too_large``).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgpack

from shared.errors import DeepinferError, ErrorCode, invalid

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 1024 * 1024   # the nats max_payload (compose/nats.conf)

MAX_LIST_LEN = 1_000_000
INT_MIN, INT_MAX = -(2**63), 2**64 - 1

Checker = Callable[[Any, str], Any]  # (value, field path) -> value to store; raises invalid(...)


def wire_field(*, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
               max_len: int | None = None) -> Any:
    """A dataclass field with an optional list-length bound."""
    meta = {"max_len": max_len} if max_len is not None else {}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def _tname(value: Any) -> str:
    return type(value).__name__


def _fail(path: str, expected: str, value: Any) -> Exception:
    return invalid(f"field {path!r}: expected {expected}, got {_tname(value)}")


def _check_int(v: Any, path: str) -> int:
    if type(v) is bool or not isinstance(v, int):
        raise _fail(path, "int", v)
    if not INT_MIN <= v <= INT_MAX:
        raise invalid(f"field {path!r}: integer {v} out of range [-2**63, 2**64-1]")
    return int(v)


def _check_float(v: Any, path: str) -> float:
    if type(v) is bool or not isinstance(v, (int, float)):
        raise _fail(path, "float", v)
    try:
        return float(v)
    except OverflowError:
        raise invalid(f"field {path!r}: number out of float range") from None


def _check_str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _fail(path, "str", v)
    return v


def _check_bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise _fail(path, "bool", v)
    return v


def _check_bytes(v: Any, path: str) -> bytes:
    if not isinstance(v, (bytes, bytearray)):
        raise _fail(path, "bytes", v)
    return bytes(v)


def _check_dict(v: Any, path: str) -> dict:
    if not isinstance(v, dict):
        raise _fail(path, "dict", v)
    for key in v:
        if not isinstance(key, str):
            raise invalid(f"field {path!r}: keys must be str, got {_tname(key)}")
    return v


def _check_any(v: Any, path: str) -> Any:
    return v


def _list_checker(item_type: Any, max_len: int) -> Checker:
    label = f"list[{getattr(item_type, '__name__', item_type)}]"
    item = None if item_type is int else _compile(item_type, MAX_LIST_LEN)

    def check(v: Any, path: str) -> list:
        if not isinstance(v, (list, tuple)):
            raise _fail(path, label, v)
        if len(v) > max_len:
            raise invalid(f"field {path!r}: at most {max_len} items allowed, got {len(v)}")
        if isinstance(v, tuple):
            v = list(v)
        if item_type is int:
            if not all(type(x) is int for x in v):  # fast path; type() also rejects bool
                for i, x in enumerate(v):
                    _check_int(x, f"{path}[{i}]")
            elif v and (min(v) < INT_MIN or max(v) > INT_MAX):
                raise invalid(f"field {path!r}: integer out of range [-2**63, 2**64-1]")
            return v
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
    return check


def _optional(inner: Checker) -> Checker:
    def check(v: Any, path: str) -> Any:
        return None if v is None else inner(v, path)
    return check


def _nested(cls: type) -> Checker:
    def check(v: Any, path: str) -> Any:
        if isinstance(v, cls):
            return v
        if isinstance(v, Mapping):
            try:
                return build(cls, v)
            except DeepinferError as err:
                raise invalid(f"field {path!r}: {err.message}") from None
        raise _fail(path, cls.__name__, v)
    return check


_SIMPLE: dict[Any, Checker] = {int: _check_int, float: _check_float, str: _check_str, bool: _check_bool,
                               bytes: _check_bytes, dict: _check_dict, Any: _check_any}


def _compile(tp: Any, max_len: int) -> Checker:
    """Build the checker for one annotation; unsupported annotations are a programming error (TypeError)."""
    if tp in _SIMPLE:
        return _SIMPLE[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"only Optional[X] unions are supported, got {tp!r}")
        return _optional(_compile(rest[0], max_len))
    if origin is list and len(args) == 1 and (args[0] in (int, float, str, dict) or args[0] in (list[int], list[float])):
        return _list_checker(args[0], max_len)
    if origin is dict and args and args[0] is str:
        return _check_dict
    if origin is None and isinstance(tp, type) and issubclass(tp, WireModel) and dataclasses.is_dataclass(tp):
        return _nested(tp)
    raise TypeError(f"unsupported wire annotation {tp!r}")


def compile_type(tp: Any, max_len: int = MAX_LIST_LEN) -> Checker:
    """Public entry to the checker of one annotation, for validating free-standing dicts."""
    return _compile(tp, max_len)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    name: str
    check: Checker
    required: bool


@functools.cache
def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """The compiled per-field checkers of a wire dataclass (computed once per class)."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        check = _compile(hints[f.name], f.metadata.get("max_len", MAX_LIST_LEN))
        specs.append(FieldSpec(f.name, check, required))
    return tuple(specs)


def field_names(cls: type) -> frozenset[str]:
    return frozenset(s.name for s in field_specs(cls))


class WireModel:
    """Base of every wire dataclass: fields are type-checked (and normalised) after ``__init__``,
    then ``_check`` runs the message's own semantic rules. Both raise only ``DeepinferError``."""

    __slots__ = ()

    def __post_init__(self) -> None:
        try:
            for spec in field_specs(type(self)):
                value = getattr(self, spec.name)
                checked = spec.check(value, spec.name)
                if checked is not value:
                    object.__setattr__(self, spec.name, checked)
            self._check()
        except DeepinferError as err:  # name the message type too
            raise DeepinferError(err.code, f"{type(self).__name__}: {err.message}") from None

    def _check(self) -> None:
        """Semantic rules of one message (ranges, mutually exclusive fields); override as needed."""

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value, nested models as dicts (lists are shared, not copied)."""
        out = {}
        for spec in field_specs(type(self)):
            value = getattr(self, spec.name)
            out[spec.name] = value.to_dict() if isinstance(value, WireModel) else value
        return out


def build(cls: type, data: Mapping) -> Any:
    """Construct ``cls`` from a mapping: rejects non-str keys, unknown and missing fields, then validates."""
    known = field_names(cls)
    for key in data:
        if not isinstance(key, str):
            raise invalid(f"{cls.__name__}: field names must be str, got {_tname(key)}")
        if key not in known:
            raise invalid(f"{cls.__name__}: unknown field {key[:64]!r}")
    for spec in field_specs(cls):
        if spec.required and spec.name not in data:
            raise invalid(f"{cls.__name__}: missing required field {spec.name!r}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as err:  # defensive: construction must only raise DeepinferError
        raise invalid(f"{cls.__name__}: {err}") from None


# ---- registry and codec --------------------------------------------------------------------------------

T = TypeVar("T")
_REGISTRY: dict[str, type] = {}
_LIMITS: dict[type, int] = {}


def wire_message(max_bytes: int = MAX_MESSAGE_BYTES):
    """Class decorator: a frozen, slotted, keyword-only WireModel dataclass, registered under its class
    name with an encoded-size limit (capped at MAX_MESSAGE_BYTES)."""
    def wrap(cls: type) -> type:
        cls = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)
        if field_names(cls) & {"v", "type"}:  # also compiles the checkers: bad annotations fail at import
            raise TypeError(f"{cls.__name__}: 'v' and 'type' are reserved")
        if cls.__name__ in _REGISTRY:
            raise TypeError(f"message type {cls.__name__} registered twice")
        _REGISTRY[cls.__name__], _LIMITS[cls] = cls, min(max_bytes, MAX_MESSAGE_BYTES)
        return cls
    return wrap


def registered_types() -> dict[str, type]:
    return dict(_REGISTRY)


def _too_large(size: int, limit: int, what: str) -> DeepinferError:
    return DeepinferError(ErrorCode.PAYLOAD_TOO_LARGE, f"{what} of {size} bytes exceeds {limit} bytes")


def encode(msg: WireModel) -> bytes:
    """Message -> msgpack bytes. Raises ``payload_too_large`` over the type's limit."""
    cls = type(msg)
    if cls not in _LIMITS:
        raise TypeError(f"not a registered wire message: {cls.__name__}")
    body = {"v": PROTOCOL_VERSION, "type": cls.__name__, **msg.to_dict()}
    try:
        data = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise invalid(f"{cls.__name__}: cannot encode: {err}") from None
    if len(data) > _LIMITS[cls]:
        raise _too_large(len(data), _LIMITS[cls], cls.__name__)
    return data


def decode(data: bytes, expected: type[T] | tuple[type, ...] | None = None) -> T:
    """msgpack bytes -> validated message, of one of the ``expected`` types when given."""
    allowed = (expected,) if isinstance(expected, type) else expected
    if allowed is not None and (not allowed or not all(t in _LIMITS for t in allowed)):
        raise TypeError(f"expected must be registered message types, got {expected!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise invalid(f"malformed message: expected bytes, got {_tname(data)}")
    size = memoryview(data).nbytes
    limit = MAX_MESSAGE_BYTES if allowed is None else max(_LIMITS[t] for t in allowed)
    if size > limit:
        raise _too_large(size, limit, "message")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_str_len=size,
                              max_bin_len=size, max_array_len=size, max_map_len=size // 2, max_ext_len=0)
    except Exception as err:  # msgpack raises many types (ExtraData, FormatError, StackError, ...)
        raise invalid(f"malformed message: {_tname(err)}: {str(err)[:200]}") from None
    if not isinstance(obj, dict):
        raise invalid(f"malformed message: expected a map, got {_tname(obj)}")
    version = obj.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise DeepinferError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {repr(version)[:64]} is not "
                             f"supported (expected {PROTOCOL_VERSION})")
    name = obj.pop("type", None)
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise invalid(f"unknown message type {repr(name)[:64]}")
    if allowed is not None and cls not in allowed:
        raise invalid(f"unexpected message type {name!r}, expected {', '.join(t.__name__ for t in allowed)}")
    if size > _LIMITS[cls]:
        raise _too_large(size, _LIMITS[cls], name)
    return build(cls, obj)
