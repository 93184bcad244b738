"""Wire protocol and subjects: round trips of every message, and every way a message must be rejected (errors
and the generic validator: test_protocol_errors.py)."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol as p
from shared.sampling import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from shared.wire_validation import WireModel
from tests.unit.test_protocol_cache import CACHE_SAMPLES
from tests.unit.test_protocol_draft import DRAFT_SAMPLES

SAMPLING = p.Sampling(max_tokens=8, temperature=0.0, seed=3, stop=["\n"])

SAMPLES = {
    "Sampling": SAMPLING,
    "Logprobs": p.Logprobs(token_logprobs=[-0.5, -1.25], top_ids=[[5, 1], [6, 2]],
                           top_logprobs=[[-0.5, -2.0], [-1.0, -1.25]]),
    "GenerateRequest": p.GenerateRequest(request_id="r1", model="m", prompt="hello", max_tokens=4, seed=7,
                                         stop=["x"], stop_token_ids=[2], prefill_mode="remote", transport="shm"),
    "TokenChunk": p.TokenChunk(request_id="r1", seq=3, token_ids=[5, 6], text="ab", final=True,
                               finish_reason="length", usage={"prompt_tokens": 4, "ttft_ms": 1.5}),
    "CancelRequest": p.CancelRequest(request_id="r1"),
    "PrefillRequest": p.PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SAMPLING,
                                       decode_worker="decode-0", transport="stream", reply_to="_INBOX.a.b",
                                       cache_salt="tenant", deadline_s=12.5),
    "KVHandoff": p.KVHandoff(request_id="r1", prompt_token_ids=[1, 2, 3], first_token=9, sampling=SAMPLING,
                             reply_to="_INBOX.a.b", cache_salt="", num_blocks=1, block_shape=[2, 2, 16, 4, 8],
                             dtype="bfloat16", transport="shm", handle={"name": "/di_shm_1", "offset": 0},
                             num_cached_tokens=2, ttft_ms=3.0, prefill_worker="prefill-0",
                             prior_output_ids=[4, 5], generator_state=b"\x01" * 16, first_seq=3),
    "DecodeLocalRequest": p.DecodeLocalRequest(request_id="r1", prompt_token_ids=[1], sampling=SAMPLING,
                                               reply_to="_INBOX.x"),
    "RequestProbe": p.RequestProbe(request_id="r1~0"),
    "MigrateRequest": p.MigrateRequest(request_id="r1~0", target="decode-1", transport="stream"),
    "RoleSwitch": p.RoleSwitch(role="prefill"),
    "ScaleRequest": p.ScaleRequest(role="decode", delta=-1),
    "ClientAdmin": p.ClientAdmin(op="add", tenant="acme"),
    "ClientAdminReply": p.ClientAdminReply(tenants=["acme"], user="client-acme", password="x"),
    "KVPrecopy": p.KVPrecopy(request_id="r1~0", token_ids=list(range(40)), cache_salt="", num_blocks=2,
                             block_shape=[2, 2, 16, 4, 8], dtype="float32", transport="shm",
                             handle={"segment": "x"}, model_fingerprint="0" * 32),
    "Ack": p.Ack(),
    "ErrorReply": p.ErrorReply(code="overloaded", message="too busy"),
    "LoadReport": p.LoadReport(worker_id="decode-0", role="decode", model_id="m", num_running=2, num_waiting=0,
                               kv_usage=0.25, num_free_blocks=30, num_total_blocks=40, block_size=16,
                               transports=["shm", "stream"], host="h", timestamp=1.0e9),
    "WorkerInfo": p.WorkerInfo(worker_id="prefill-0", role="prefill", model_id="m", host="h", pid=42,
                               transports=["stream"], block_size=16, started_at=1.0e9),
    "KVEvent": p.KVEvent(worker_id="prefill-0", seq=1, kind="stored", block_hashes=[0, 1, 2**63, 2**64 - 1]),
    "KVSnapshot": p.KVSnapshot(worker_id="decode-0", seq=7, block_hashes=[3, 2**64 - 1]),
    **CACHE_SAMPLES,
    **DRAFT_SAMPLES,
}


def raw(msg_type: str, **fields) -> bytes:
    """Hand-made wire bytes (bypass encode's validation)."""
    return msgpack.packb({"v": 1, "type": msg_type, **fields})


def body(msg: WireModel, **overrides) -> bytes:
    return raw(type(msg).__name__, **{**msg.to_dict(), **overrides})


def code_of(data: bytes, expected=None) -> DeepinferError:
    with pytest.raises(DeepinferError) as info:
        p.decode(data, expected)
    return info.value


# ---- round trips -----------------------------------------------------------------------------------------

def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(p.MESSAGE_TYPES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name):
    msg = SAMPLES[name]
    data = p.encode(msg)
    assert msgpack.unpackb(data)["v"] == p.PROTOCOL_VERSION
    assert msgpack.unpackb(data)["type"] == name
    assert p.decode(data) == msg
    assert p.decode(data, type(msg)) == msg
    assert p.decode(data, (p.Ack, type(msg))) == msg


def test_messages_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES["Ack"].ok = False
    with pytest.raises(TypeError):
        p.CancelRequest("r1")


def test_uint64_block_hashes():
    hashes = [2**64 - 1, 2**63, 2**32, 0]
    ev = p.decode(p.encode(p.KVEvent(worker_id="w", seq=0, kind="stored", block_hashes=hashes)))
    assert ev.block_hashes == hashes
    for bad in (2**64, -1):
        with pytest.raises(DeepinferError, match="block_hashes"):
            p.KVEvent(worker_id="w", seq=0, kind="removed", block_hashes=[1, bad])


def test_a_migration_hand_off_is_bounded():
    for bad in ({"prior_output_ids": [-1]}, {"generator_state": b"\0" * (17 << 10)}, {"first_seq": 0},
                {"generator_state": "text"}):
        with pytest.raises(DeepinferError) as info:
            p.decode(body(SAMPLES["KVHandoff"], **bad))
        assert info.value.code is ErrorCode.INVALID_REQUEST
    for bad in ({"request_id": ""}, {"target": "a.b"}, {"target": "x" * 200}):
        with pytest.raises(DeepinferError):
            p.decode(body(SAMPLES["MigrateRequest"], **bad))


def test_a_role_switch_names_a_worker_role():
    for bad in ("router", "", "both"):
        with pytest.raises(DeepinferError) as info:
            p.decode(body(SAMPLES["RoleSwitch"], role=bad))
        assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(DeepinferError):
        p.decode(body(SAMPLES["LoadReport"], step_ms=-1.0))
    for bad in ({"delta": 2}, {"delta": 0}, {"role": "router"}):
        with pytest.raises(DeepinferError):
            p.decode(body(SAMPLES["ScaleRequest"], **bad))
    for bad in ({"op": "grant"}, {"tenant": ""}):   # a client request names what and whom
        with pytest.raises(DeepinferError):
            p.decode(body(SAMPLES["ClientAdmin"], **bad))
    assert p.decode(body(SAMPLES["ClientAdmin"], op="list", tenant=""), p.ClientAdmin).op == "list"


def test_int_accepted_for_float_and_stored_as_float():
    msg = p.decode(body(SAMPLES["LoadReport"], kv_usage=1, timestamp=5))
    assert msg.kv_usage == 1.0 and type(msg.kv_usage) is float and type(msg.timestamp) is float


def test_sampling_is_one_nested_typed_message():
    msg = p.decode(p.encode(SAMPLES["KVHandoff"]))
    assert isinstance(msg.sampling, p.Sampling) and msg.sampling == SAMPLING
    assert p.PrefillRequest(**{**SAMPLES["PrefillRequest"].to_dict(), "sampling": {"seed": 3}}).sampling.seed == 3
    for bad in ({"bogus": 1}, {"max_tokens": True}, {"top_k": "3"}, {"temperature": -1.0}, [1],
                {"max_tokens": 2, "min_tokens": 3}, {"min_tokens": -1}, {"temperature": float("nan")},
                {"stop": ["x"] * 17}, {"stop_token_ids": [-1]}):
        with pytest.raises(DeepinferError, match="sampling") as info:
            p.decode(body(SAMPLES["KVHandoff"], sampling=bad))
        assert info.value.code is ErrorCode.INVALID_REQUEST


def test_wire_and_engine_sampling_rules_agree():
    """The same rules run on the wire and in the engine: what one accepts, the other accepts."""
    for kwargs in ({"max_tokens": 5, "temperature": 0.5, "top_k": 3, "top_p": 0.9, "seed": 1, "stop": ["a"],
                    "stop_token_ids": [7], "ignore_eos": True, "min_tokens": 2}, {"top_p": 0.0}, {"seed": 2**63},
                   {"top_k": -2}, {"stop": [""]}):
        wire_ok = engine_ok = True
        try:
            p.Sampling(**kwargs)
        except DeepinferError:
            wire_ok = False
        try:
            SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})
        except DeepinferError:
            engine_ok = False
        assert wire_ok == engine_ok, kwargs


def test_generate_request_sampling():
    sp = SAMPLES["GenerateRequest"].sampling()
    assert (sp.max_tokens, sp.seed, sp.stop, sp.stop_token_ids) == (4, 7, ["x"], [2])


# ---- rejections ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x81", b"\xa3abc", b"\x91\x01", b"\x01\x02",
                                  msgpack.packb({"v": 1, "type": "Ack"}) + b"\x00",
                                  msgpack.packb({1: 2}), b"\xd4\x01\x00"])
def test_garbage_is_invalid_request(data):
    err = code_of(data)
    assert err.code is ErrorCode.INVALID_REQUEST and "malformed message" in err.message


def test_non_bytes_input():
    assert code_of("text").code is ErrorCode.INVALID_REQUEST


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_deepinfer_error(data):
    try:
        p.decode(data)
    except DeepinferError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_random_fields_only_raise_deepinfer_error(name, data):
    fields = SAMPLES[name].to_dict()
    keys = data.draw(st.lists(st.sampled_from(sorted(fields) + ["extra"]), max_size=4, unique=True))
    for key in keys:
        fields[key] = data.draw(_values)
    try:
        msg = p.decode(raw(name, **fields))
    except DeepinferError as err:
        assert err.code is ErrorCode.INVALID_REQUEST
    else:
        assert type(msg).__name__ == name


@pytest.mark.parametrize("version", [None, 0, 2, "1", True, 1.0])
def test_wrong_or_missing_version(version):
    fields = {"type": "Ack", "ok": True, "detail": ""}
    if version is not None:
        fields["v"] = version
    assert code_of(msgpack.packb(fields)).code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("msg_type", ["Nope", "", None, 7, "WireModel"])
def test_unknown_type(msg_type):
    fields = {"v": 1, "ok": True}
    if msg_type is not None:
        fields["type"] = msg_type
    err = code_of(msgpack.packb(fields))
    assert err.code is ErrorCode.INVALID_REQUEST and "unknown message type" in err.message


def test_type_not_in_expected():
    err = code_of(p.encode(p.Ack()), (p.TokenChunk, p.GenerateRequest))
    assert err.code is ErrorCode.INVALID_REQUEST and "unexpected message type 'Ack'" in err.message
    with pytest.raises(TypeError):
        p.decode(p.encode(p.Ack()), dict)


def test_missing_required_field_is_named():
    fields = SAMPLES["PrefillRequest"].to_dict()
    del fields["decode_worker"]
    err = code_of(raw("PrefillRequest", **fields))
    assert err.code is ErrorCode.INVALID_REQUEST and "'decode_worker'" in err.message


@pytest.mark.parametrize("name,field,value", [
    ("GenerateRequest", "max_tokens", "5"), ("GenerateRequest", "max_tokens", True),
    ("GenerateRequest", "max_tokens", 5.0), ("GenerateRequest", "temperature", False),
    ("GenerateRequest", "temperature", "hot"), ("GenerateRequest", "prompt", 5),
    ("GenerateRequest", "ignore_eos", 1), ("GenerateRequest", "stop", "x"), ("GenerateRequest", "stop", [1]),
    ("TokenChunk", "seq", True), ("TokenChunk", "token_ids", [1, True]), ("TokenChunk", "token_ids", [1, "2"]),
    ("TokenChunk", "usage", [1]), ("PrefillRequest", "prompt_token_ids", None),
    ("KVHandoff", "handle", "h"), ("KVHandoff", "block_shape", [2, 1.5]), ("WorkerInfo", "pid", 4.0),
    ("LoadReport", "transports", [b"shm"]), ("ErrorReply", "code", b"x"), ("Ack", "ok", 1),
])
def test_mistyped_field_is_named(name, field, value):
    err = code_of(body(SAMPLES[name], **{field: value}))
    assert err.code is ErrorCode.INVALID_REQUEST and f"field '{field}" in err.message, err.message


def test_unknown_extra_field_is_named():
    err = code_of(body(SAMPLES["CancelRequest"], reason="bored"))
    assert err.code is ErrorCode.INVALID_REQUEST and "'reason'" in err.message


def test_oversize_payloads():
    assert code_of(b"\x00" * (p.MAX_MESSAGE_BYTES + 1)).code is ErrorCode.PAYLOAD_TOO_LARGE
    # rejected before parsing when the expected types' limits are smaller
    assert code_of(b"\x00" * (p.MAX_CHUNK_BYTES + 1), p.TokenChunk).code is ErrorCode.PAYLOAD_TOO_LARGE
    big = "x" * (p.MAX_CHUNK_BYTES + 10)
    with pytest.raises(DeepinferError) as info:
        p.encode(p.TokenChunk(request_id="r", seq=0, token_ids=[], text=big))
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert code_of(raw("TokenChunk", request_id="r", seq=0, token_ids=[], text=big)).code \
        is ErrorCode.PAYLOAD_TOO_LARGE
    prompt = "y" * p.MAX_REQUEST_BYTES
    assert code_of(raw("GenerateRequest", prompt=prompt)).code is ErrorCode.PAYLOAD_TOO_LARGE


def test_list_length_limits():
    msgs = [{"role": "user", "content": "x"}] * (p.MAX_CHAT_MESSAGES + 1)
    err = code_of(raw("GenerateRequest", messages=msgs))
    assert err.code is ErrorCode.INVALID_REQUEST and "'messages'" in err.message


def test_max_size_prompt_fits_internal_messages():
    ids = [151_000] * p.MAX_PROMPT_TOKENS  # 5 bytes each on the wire
    req = p.PrefillRequest(request_id="r", prompt_token_ids=ids, sampling=SAMPLING, decode_worker="d",
                           transport="stream", reply_to="_INBOX.r", deadline_s=1.0)
    assert len(p.decode(p.encode(req), p.PrefillRequest).prompt_token_ids) == p.MAX_PROMPT_TOKENS


@pytest.mark.parametrize("forms", [{}, {"prompt": "a", "prompt_token_ids": [1]},
                                   {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}])
def test_generate_request_needs_exactly_one_prompt_form(forms):
    err = code_of(raw("GenerateRequest", **forms))
    assert err.code is ErrorCode.INVALID_REQUEST and "exactly one of" in err.message


@pytest.mark.parametrize("fields", [
    {"messages": []}, {"messages": [{"role": "user"}]}, {"messages": [{"role": "", "content": "x"}]},
    {"messages": [1]}, {"prompt_token_ids": []}, {"prompt_token_ids": [-1]},
    {"prompt": "a", "timeout_s": 0.0}, {"prompt": "a", "timeout_s": 3601}, {"prompt": "a", "timeout_s": float("nan")},
    {"prompt": "a", "prefill_mode": "sometimes"}, {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "top_p": 0.0},
    {"prompt": "a", "temperature": -0.5}, {"prompt": "a", "seed": -1}, {"prompt": "a", "request_id": "r" * 300},
    {"prompt": "a", "request_id": "x~0"}, {"prompt": "a", "max_tokens": 2, "min_tokens": 3},
])
def test_generate_request_semantic_rejections(fields):
    assert code_of(raw("GenerateRequest", **fields)).code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("name,overrides", [
    ("TokenChunk", {"seq": -1}), ("TokenChunk", {"final": False}),
    ("TokenChunk", {"final": True, "error": {"code": 1}}), ("CancelRequest", {"request_id": ""}),
    ("PrefillRequest", {"decode_worker": "a.b"}), ("PrefillRequest", {"reply_to": "_INBOX.*"}),
    ("PrefillRequest", {"deadline_s": float("inf")}), ("KVHandoff", {"dtype": "torch.float32"}),
    ("KVHandoff", {"num_cached_tokens": 6}), ("KVHandoff", {"block_shape": []}),
    ("KVHandoff", {"transport": ""}), ("KVHandoff", {"first_token": -3}),
    ("LoadReport", {"worker_id": "w 1"}), ("LoadReport", {"role": "boss"}), ("LoadReport", {"kv_usage": 1.5}),
    ("WorkerInfo", {"worker_id": "w>"}), ("KVEvent", {"kind": "moved"}), ("ErrorReply", {"code": ""}),
])
def test_message_semantic_rejections(name, overrides):
    assert code_of(body(SAMPLES[name], **overrides)).code is ErrorCode.INVALID_REQUEST


def test_a_resume_names_what_the_client_has_and_must_leave_tokens_to_generate():
    ok = p.GenerateRequest(prompt="x", max_tokens=4, resume_tokens=[5, 6], resume_seq=2)
    assert p.decode(p.encode(ok), p.GenerateRequest) == ok
    for bad in ({"resume_tokens": [5], "resume_seq": 0}, {"resume_tokens": [5, 6, 7, 8], "resume_seq": 4},
                {"resume_seq": -1}, {"resume_tokens": [-3], "resume_seq": 1}):
        with pytest.raises(DeepinferError) as err:
            p.GenerateRequest(prompt="x", max_tokens=4, **bad)
        assert err.value.code == ErrorCode.INVALID_REQUEST
