"""``stream`` KV transport (any host): the receiver pulls the payload from the sender in chunks over NATS.

Handle: {"transport": "stream", "subject": subjects.kv_pull(<sender>, <transfer>), "chunk": bytes per chunk, "chunks": count,
"nbytes", "dtype", "shape"}. Pull request body: msgpack {"i": chunk index}; reply body: the raw chunk bytes
(``payload[i*chunk : (i+1)*chunk]``), or an empty body with header ``Kv-Error`` on a bad request.

Invariants:
- Pull-based: the sender only sends a chunk when asked, and the receiver keeps at most ``max_inflight``
  requests outstanding, so neither the server nor either client buffers more than
  ``max_inflight * chunk_bytes``; a slow receiver is never cut off as a slow consumer.
- ``chunk_bytes`` stays below the server's max_payload (checked at ``stage`` against ``nc.max_payload``).
- ``stage`` returns only after the server knows the sender's subscription (flush), so a handle that reaches
  a receiver on another connection is immediately fetchable.
- A chunk request that times out is retried ``retries`` times (default 2), then TRANSFER_FAILED; "no
  responders" (released or unknown transfer) fails at once; the whole fetch is bounded by ``timeout``.
- The sender keeps a reference to the payload (no copy) until ``release``; the payload must not change.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import msgpack
import numpy as np
import torch
from nats import errors as nats_errors

from shared import subjects
from shared.kv.transport import (KVTransport, handle_fields, as_bytes, check_payload, dtype_name,
                                 sync_with_server, transfer_failed, unsubscribe_quietly)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
ERROR_HEADER = "Kv-Error"
_PAYLOAD_SLACK = 64 << 10        # room under max_payload for the protocol line and headers


class _Staged:
    """One staged transfer: the payload's bytes as a flat uint8 numpy view plus its pull subscription."""

    def __init__(self, data: np.ndarray, payload: torch.Tensor, chunk: int) -> None:
        self.data = data            # uint8 [nbytes], a view of payload (no copy)
        self.payload = payload      # keeps the memory alive
        self.chunk = chunk
        self.sub = None

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])


class StreamTransport(KVTransport):
    name = "stream"

    def __init__(self, nc, worker_id: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_inflight: int = 4,
                 request_timeout: float = 2.0, retries: int = 2, **kwargs) -> None:
        super().__init__(nc, worker_id, **kwargs)
        if chunk_bytes <= 0 or max_inflight <= 0 or retries < 0:
            raise ValueError("chunk_bytes and max_inflight must be > 0, retries >= 0")
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.request_timeout = request_timeout
        self.retries = retries
        self._staged: dict[str, _Staged] = {}

    def subject_for(self, transfer_id: str) -> str:
        # Worker id in the subject: two senders may stage the same request id (re-placement after a failure),
        # and NATS permissions let an instance serve only its own transfers.
        return subjects.kv_pull(subjects.safe_token(self.worker_id), subjects.safe_token(transfer_id))

    # ---------------------------------------------------------------- sender
    async def stage(self, payload: torch.Tensor, transfer_id: str) -> dict:
        self._check_open()
        payload = check_payload(payload)                       # [n, *block_shape] contiguous CPU
        self._check_new(transfer_id)
        max_payload = getattr(self.nc, "max_payload", 0) or 0
        if max_payload and self.chunk_bytes > max_payload - _PAYLOAD_SLACK:
            raise transfer_failed(f"chunk_bytes {self.chunk_bytes} does not fit the server's max_payload "
                                  f"{max_payload} (minus {_PAYLOAD_SLACK} B of slack)")
        data = as_bytes(payload).numpy()
        entry = _Staged(data, payload, self.chunk_bytes)
        await self._reserve(transfer_id, entry.nbytes)
        self._staged[transfer_id] = entry
        subject = self.subject_for(transfer_id)
        try:
            entry.sub = await self.nc.subscribe(subject, cb=functools.partial(self._serve, entry))
            await sync_with_server(self.nc, self.stage_timeout)
        except Exception as exc:
            await self.release(transfer_id)
            raise transfer_failed(f"cannot serve transfer {transfer_id!r} on {subject}: {exc!r}") from exc
        chunks = -(-entry.nbytes // entry.chunk)
        return {"transport": self.name, "subject": subject, "chunk": entry.chunk, "chunks": chunks,
                "nbytes": entry.nbytes, "dtype": dtype_name(payload.dtype), "shape": list(payload.shape)}

    async def _serve(self, entry: _Staged, msg) -> None:
        """Reply to one pull with chunk bytes; bad requests get an error header (never an exception)."""
        if not msg.reply:
            return
        try:
            i = int(msgpack.unpackb(msg.data)["i"])
            start = i * entry.chunk
            if i < 0 or start >= max(entry.nbytes, 1) or (entry.nbytes == 0 and i != 0):
                raise ValueError(f"chunk {i} out of range")
            body = entry.data[start:start + entry.chunk].data   # memoryview: nats-py copies it once
        except Exception as exc:  # noqa: BLE001 - reported to the puller
            await self._reply(msg.reply, b"", {ERROR_HEADER: str(exc)[:200] or type(exc).__name__})
            return
        await self._reply(msg.reply, body)

    async def _reply(self, subject: str, body: bytes, headers: dict | None = None) -> None:
        try:
            await self.nc.publish(subject, body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - the puller times out and retries
            log.warning("stream: reply to %s failed: %r", subject, exc)

    async def release(self, transfer_id: str) -> None:
        entry = self._staged.pop(transfer_id, None)
        if entry is None:
            return
        if entry.sub is not None:
            await unsubscribe_quietly(self.nc, entry.sub)
        await self.budget.release(entry.nbytes)

    # ---------------------------------------------------------------- receiver
    async def _pull(self, subject: str, i: int, deadline: float) -> bytes:
        """Chunk ``i``: request, retried on timeout ``self.retries`` times; errors -> TRANSFER_FAILED."""
        body = msgpack.packb({"i": i})
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                msg = await self.nc.request(subject, body, timeout=min(self.request_timeout, left))
            except nats_errors.NoRespondersError:
                raise transfer_failed(f"no sender serves {subject} (transfer released, unknown or sender gone)")
            except nats_errors.TimeoutError:
                log.info("stream: chunk %d of %s timed out (attempt %d)", i, subject, attempt + 1)
                continue
            except Exception as exc:  # connection closed, draining, ...
                raise transfer_failed(f"pulling chunk {i} of {subject}: {exc!r}") from exc
            if msg.headers and ERROR_HEADER in msg.headers:
                raise transfer_failed(f"sender refused chunk {i} of {subject}: {msg.headers[ERROR_HEADER]}")
            return msg.data
        raise transfer_failed(f"chunk {i} of {subject} not received after {self.retries + 1} attempts "
                              "or the fetch deadline passed")

    async def fetch(self, handle: dict, out: torch.Tensor | None = None, timeout: float = 10.0) -> torch.Tensor:
        result, nbytes = self._fetch_target(handle, out)
        subject, chunk, chunks = handle_fields(handle, "stream", subject=str, chunk=int, chunks=int)
        if not subjects.is_kv_pull(subject):  # never publish to a subject a peer made up (long ones kill the link)
            raise transfer_failed(f"stream handle subject {subject[:64]!r} is not a KV pull subject")
        if nbytes == 0:
            return result
        if chunk <= 0 or chunks != -(-nbytes // chunk):
            raise transfer_failed(f"stream handle: {chunks} chunks of {chunk} B cannot hold {nbytes} B")
        dst = as_bytes(result).numpy()                         # uint8 [nbytes] view of result
        deadline = time.monotonic() + timeout
        todo = iter(range(chunks))

        async def worker() -> None:
            for i in todo:  # shared iterator: each index is taken by exactly one worker
                data = await self._pull(subject, i, deadline)
                start = i * chunk
                expect = min(chunk, nbytes - start)
                if len(data) != expect:
                    raise transfer_failed(f"chunk {i} of {subject}: {len(data)} B, expected {expect} B")
                dst[start:start + expect] = np.frombuffer(data, dtype=np.uint8)

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(self.max_inflight, chunks))]
        gathered = asyncio.gather(*tasks)
        try:
            # The pulls bound themselves by the deadline; wait_for is the backstop (+1 s grace).
            await asyncio.wait_for(gathered, timeout + 1.0)
        except asyncio.TimeoutError:
            raise transfer_failed(f"fetch of {subject} exceeded {timeout:.1f} s") from None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if gathered.done() and not gathered.cancelled():
                gathered.exception()  # retrieved: a failure after a cancel is not "never retrieved"
        return result

    async def close(self) -> None:
        if not await self._close_staged():
            return
