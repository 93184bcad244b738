"""Bounded waits of the HTTP API towards a client that takes nothing (issue 21): a write that cannot complete
within ``STALL_S`` closes the client's connection and raises (the handler then cancels the request on the
workers), and the relay's queue never blocks longer than ``STALL_S``. The client is simulated by a response whose
write never completes (fault injection: a full TCP window)."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.router import http_api
from shared import protocol


class NeverDrains:
    """A response whose write waits forever (the client's window is full), and its request's transport."""

    def __init__(self) -> None:
        self.aborted = False
        self.transport = self

    def abort(self) -> None:
        self.aborted = True

    async def write(self, data: bytes) -> None:
        await asyncio.Event().wait()


async def test_a_write_to_a_client_that_reads_nothing_is_cut_off(monkeypatch):
    monkeypatch.setattr(http_api, "STALL_S", 0.2)
    stuck = NeverDrains()
    t0 = time.monotonic()
    with pytest.raises(ConnectionResetError, match="read nothing"):
        await http_api._sse(stuck, stuck, {"x": 1})
    assert stuck.aborted and time.monotonic() - t0 < 2.0


async def test_the_relay_never_waits_on_a_full_queue_longer_than_the_bound(monkeypatch):
    monkeypatch.setattr(http_api, "STALL_S", 0.2)
    sink = http_api.ChunkSink()
    chunk = protocol.TokenChunk(request_id="r", seq=0, token_ids=[1], text="a")
    for _ in range(http_api.QUEUE_CHUNKS):
        await sink.send(chunk)
    t0 = time.monotonic()
    await sink.send(chunk)                      # full and nobody reads: dropped after the bound
    await sink.send(chunk)                      # and from then on at once
    assert sink.closed and time.monotonic() - t0 < 2.0
    assert sink.queue.qsize() == http_api.QUEUE_CHUNKS
