"""Cache-tier and stats wire messages: samples (round-tripped by test_protocol) and their rejections."""
from __future__ import annotations

import msgpack
import pytest

from shared import protocol as p
from shared.errors import DeepinferError, ErrorCode

BLOCKS = dict(transfer_id="t-1", worker_id="prefill-0", retention="chat", block_hashes=[1, 2**64 - 1],
              token_ids=list(range(8)), block_size=4, dtype="float32", block_shape=[2, 2, 3, 4, 8])

CACHE_SAMPLES = {
    "CachePut": p.CachePut(**BLOCKS, transport="shm", handle={"transport": "shm", "segment": "x"}, tenant="a"),
    "CacheGet": p.CacheGet(**BLOCKS, transports=["shm", "stream"], host="h"),
    "CacheGetReply": p.CacheGetReply(num_blocks=3, dram_blocks=1, ssd_blocks=2, transport="stream",
                                     handle={"transport": "stream", "subject": "di.v1.kv.cache-0.pull.t-1"}),
    "CacheRelease": p.CacheRelease(transfer_id="t-1"),
    "StatsRequest": p.StatsRequest(),
    "StatsReply": p.StatsReply(worker_id="cache-0", role="cache_tier", stats={"hits": 3, "by": {"a": 1.5}}),
}


def raw(msg_type: str, **fields) -> bytes:
    return msgpack.packb({"v": 1, "type": msg_type, **fields})


@pytest.mark.parametrize("name", ["CachePut", "CacheGet"])
@pytest.mark.parametrize("override", [
    {"block_hashes": []}, {"block_hashes": [-1, 2]},
    {"token_ids": list(range(7))}, {"token_ids": [0] * 7 + [2**32]}, {"block_size": 0},
    {"block_size": 2048}, {"dtype": "complex64"}, {"block_shape": []}, {"block_shape": [2, 0]},
    {"block_shape": [1] * 9}, {"retention": ""}, {"transfer_id": "a.b"}, {"worker_id": "w*"},
    {"tenant": "x" * 300},
])
def test_bad_block_lists_are_invalid_requests(name, override):
    msg = CACHE_SAMPLES[name]
    with pytest.raises(DeepinferError) as info:
        p.decode(raw(name, **{**msg.to_dict(), **override}))
    assert info.value.code == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("override", [{"num_blocks": 2}, {"num_blocks": -1}, {"transport": "", "handle": {}},
                                      {"dram_blocks": -1, "ssd_blocks": 4}])
def test_bad_get_replies_are_rejected(override):
    msg = CACHE_SAMPLES["CacheGetReply"]
    with pytest.raises(DeepinferError) as info:
        p.decode(raw("CacheGetReply", **{**msg.to_dict(), **override}))
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_an_empty_get_reply_needs_no_handle():
    assert p.decode(p.encode(p.CacheGetReply(num_blocks=0))).handle == {}


def test_put_needs_a_transport_and_get_a_transport_list():
    with pytest.raises(DeepinferError):
        p.CachePut(**BLOCKS, transport="", handle={})
    with pytest.raises(DeepinferError):
        p.CacheGet(**BLOCKS, transports=[])


@pytest.mark.parametrize("override", [
    {"window_mask": b"\x01"},                              # blocks without window rows, no full_layers
    {"window_mask": b"\x01", "full_layers": 2},            # full_layers must be fewer than the block's layers
    {"window_mask": b"\x01\x00", "full_layers": 1},        # one byte per 8 blocks
    {"window_mask": b"\x04", "full_layers": 1},            # a bit past the last block
    {"full_layers": -1}, {"full_layers": 3},
])
def test_bad_packed_puts_are_invalid_requests(override):
    msg = CACHE_SAMPLES["CachePut"]
    with pytest.raises(DeepinferError) as info:
        p.decode(raw("CachePut", **{**msg.to_dict(), **override}))
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_a_packed_put_and_reply_round_trip():
    put = p.CachePut(**BLOCKS, transport="shm", handle={"transport": "shm"}, full_layers=1, window_mask=b"\x02")
    assert p.decode(p.encode(put)).window_mask == b"\x02"
    reply = p.CacheGetReply(num_blocks=3, transport="stream", handle={"x": 1}, dram_blocks=3, window_mask=b"\x04")
    assert p.decode(p.encode(reply)).window_mask == b"\x04"
    with pytest.raises(DeepinferError):
        p.CacheGetReply(num_blocks=2, transport="stream", handle={"x": 1}, dram_blocks=2, window_mask=b"\x04")
