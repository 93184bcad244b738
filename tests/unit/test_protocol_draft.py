"""Draft-service wire messages: samples (round-tripped by test_protocol) and their rejections."""
from __future__ import annotations

import msgpack
import pytest

from shared import protocol as p
from shared.errors import DeepinferError, ErrorCode

DRAFT_SAMPLES = {
    "DraftRequest": p.DraftRequest(k=5, lengths=[3, 2], tokens=[1, 2, 3, 4, 5]),
    "DraftReply": p.DraftReply(lengths=[2, 0], tokens=[7, 8], features=[0.9, 0.1, 0, 0, 0.5, 0.7, 0, 1]),
}


def raw(msg_type: str, **fields) -> bytes:
    return msgpack.packb({"v": 1, "type": msg_type, **fields})


@pytest.mark.parametrize("name,override", [
    ("DraftRequest", {"k": 0}), ("DraftRequest", {"k": 17}), ("DraftRequest", {"lengths": []}),
    ("DraftRequest", {"lengths": [3, 3]}), ("DraftRequest", {"lengths": [5, 0]}),
    ("DraftRequest", {"tokens": [1, 2, 3, 4, -5]}),
    ("DraftReply", {"lengths": [3, 0]}), ("DraftReply", {"features": [0.9]}), ("DraftReply", {"lengths": [17, 0]}),
])
def test_bad_draft_messages_are_invalid_requests(name, override):
    with pytest.raises(DeepinferError) as info:
        p.decode(raw(name, **{**DRAFT_SAMPLES[name].to_dict(), **override}))
    assert info.value.code == ErrorCode.INVALID_REQUEST
