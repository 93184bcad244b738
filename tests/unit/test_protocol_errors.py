"""Wire protocol: error messages and replies, and the generic validator (nested models, dict keys, bounded
reply subjects). Message samples and helpers come from tests/unit/test_protocol.py."""
from __future__ import annotations

import dataclasses

import pytest

from shared import protocol as p
from shared.errors import DeepinferError, ErrorCode
from shared.wire_validation import WireModel, build, wire_field
from tests.unit.test_protocol import SAMPLES, body

# ---- errors ----------------------------------------------------------------------------------------------

def test_token_chunk_error_round_trip():
    err = DeepinferError(ErrorCode.WORKER_LOST, "decode-1 died")
    chunk = p.decode(p.encode(p.TokenChunk.from_error("r1", 7, err)), p.TokenChunk)
    assert chunk.final and chunk.seq == 7 and chunk.finish_reason == "error"
    with pytest.raises(DeepinferError) as info:
        chunk.raise_if_error()
    assert info.value.code is ErrorCode.WORKER_LOST and info.value.message == "decode-1 died"
    SAMPLES["TokenChunk"].raise_if_error()  # no error: no raise
    future = p.TokenChunk(request_id="r", seq=0, token_ids=[], final=True, error={"code": "new", "message": "m"})
    with pytest.raises(DeepinferError) as info:
        future.raise_if_error()
    assert info.value.code is ErrorCode.INTERNAL and "new" in info.value.message


def test_error_reply_and_decode_reply():
    err = DeepinferError(ErrorCode.OVERLOADED, "queue full")
    reply = p.ErrorReply.from_exception(err)
    assert reply.to_exception().code is ErrorCode.OVERLOADED
    with pytest.raises(DeepinferError) as info:
        p.decode_reply(p.encode(reply), p.Ack)
    assert info.value.code is ErrorCode.OVERLOADED and info.value.message == "queue full"
    assert p.decode_reply(p.encode(p.Ack(detail="ok")), p.Ack).detail == "ok"
    assert p.ErrorReply.from_exception(KeyError("secret")).code == "internal"
    with pytest.raises(DeepinferError) as info:
        p.decode_reply(p.encode(p.TokenChunk(request_id="r", seq=0, token_ids=[])), p.Ack)
    assert info.value.code is ErrorCode.INVALID_REQUEST


def test_error_headers():
    headers = p.error_headers(DeepinferError(ErrorCode.OVERLOADED, "queue\r\nfull"))
    assert headers["Nats-Service-Error-Code"] == "429" and headers["Di-Error-Code"] == "overloaded"
    assert all(isinstance(v, str) and "\n" not in v and "\r" not in v for v in headers.values())


def test_encode_rejects_unregistered_objects():
    with pytest.raises(TypeError):   # a WireModel dataclass never registered with @wire_message
        p.encode(_Inner(x=1))


# ---- the generic validator -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inner(WireModel):
    x: int
    tags: list[str] = wire_field(default_factory=list, max_len=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outer(WireModel):
    inner: _Inner
    maybe: _Inner | None = None
    blob: bytes = b""


def test_nested_models():
    outer = build(_Outer, {"inner": {"x": 1}, "maybe": {"x": 2, "tags": ("a",)}, "blob": b"\x00"})
    assert outer.inner == _Inner(x=1) and outer.maybe.tags == ["a"]
    assert outer.to_dict() == {"inner": {"x": 1, "tags": []}, "maybe": {"x": 2, "tags": ["a"]}, "blob": b"\x00"}
    for bad, word in [({"inner": {"x": "1"}}, "'x'"), ({"inner": {}}, "'x'"), ({"inner": 3}, "'inner'"),
                      ({"inner": {"x": 1, "tags": ["a", "b", "c"]}}, "'tags'"), ({"inner": {"x": 1, "y": 2}}, "'y'"),
                      ({"inner": {"x": 1}, "blob": "s"}, "'blob'"), ({"inner": {"x": 2**64}}, "'x'")]:
        with pytest.raises(DeepinferError, match=word) as info:
            build(_Outer, bad)
        assert info.value.code is ErrorCode.INVALID_REQUEST


def test_dict_keys_must_be_str():
    with pytest.raises(DeepinferError, match="'handle'"):
        dataclasses.replace(SAMPLES["KVHandoff"], handle={1: "x"})


def test_reply_subjects_are_bounded():
    """nats-server drops a connection whose PUB line passes 4 KiB: a long reply_to must never reach a worker."""
    with pytest.raises(DeepinferError, match="reply_to"):
        p.decode(body(SAMPLES["DecodeLocalRequest"], reply_to="_INBOX." + "a" * 600))
