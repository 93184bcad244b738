"""KV transfer transports: one interface, several ways to move a prefill worker's KV blocks to a decode worker.

The sender gathers a request's blocks into one contiguous tensor ``payload = kv_cache[block_ids]`` of
shape [n, *block_shape] and calls ``stage(payload, transfer_id)``; the returned ``handle`` (a msgpack-able
dict) travels in the hand-off header; the receiver calls ``fetch(handle)`` and gets an identical tensor (same
dtype, shape, bytes; on the host, except ``cuda_ipc``: on the receiver's GPU). ``stage_blocks(kv_cache,
block_ids, transfer_id)`` is the same hand-off without the intermediate payload: shm gathers straight into
shared memory, nixl reads the blocks in place (4-5x less sender time for 64 MiB here). Once the receiver
acked, or the hand-off failed or timed out, the sender calls ``release(transfer_id)``.

Invariants (every transport):
- Handles hold only str/int/float/bytes/list/dict and always carry ``transport``, ``dtype`` (e.g.
  ``"float16"``), ``shape`` (list[int]) and ``nbytes``.
- Every wait is bounded: ``fetch`` fails within ``timeout`` seconds, staging waits at most
  ``stage_timeout`` for room; failures raise ``DeepinferError(ErrorCode.TRANSFER_FAILED, ...)``. Callers size a
  wait for a payload by its bytes (``transfer_timeout``): a long context's KV is not cut by a fixed timeout.
- Sender staging is bounded by ``max_staged_bytes``; a payload larger than the bound fails at once.
- ``release`` is idempotent and frees the staging of that transfer; ``close`` releases everything.
- The payload must not be modified between ``stage`` and ``release`` (zero-copy transports read it late).
- ``stage_blocks`` takes a contiguous cache on any device. A CPU cache costs one copy at most (the gather
  into the staging; nixl: none). A device cache is gathered on its device (``index_select``) and then
  copied to the host exactly once, into the staging itself where the transport has one (shm: the
  segment); ``cuda_ipc`` gathers on the device straight into its staged tensor (no host copy at all).

This module is the base only and imports no transport; ``shared.kv.registry`` lists and builds them.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from shared.errors import DeepinferError, ErrorCode
from shared.kv.kv_codec import COMPRESSED_DTYPES

log = logging.getLogger(__name__)

DEFAULT_MAX_STAGED_BYTES = 1 << 30   # 1 GiB of sender staging per transport instance
DEFAULT_STAGE_TIMEOUT = 5.0          # seconds stage() waits for staging room before TRANSFER_FAILED
MIN_TRANSFER_BYTES_PER_S = 100e6      # the slowest link a transfer's timeout allows for (transfer_timeout)
THREAD_COPY_BYTES = 4 << 20          # copies at least this big run in a worker thread (numpy's copy drops the GIL)


def transfer_failed(message: str) -> DeepinferError:
    return DeepinferError(ErrorCode.TRANSFER_FAILED, message)


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
                 "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_DTYPES.update({name: torch.uint8 for name in COMPRESSED_DTYPES})  # the tier's compressed rows, as bytes


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (the wire name used in handles)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise transfer_failed(f"unsupported KV dtype {dtype}")
    return name


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise transfer_failed(f"unknown dtype {name!r} in KV handle") from None


def check_payload(payload: torch.Tensor) -> torch.Tensor:
    """Validate a payload for staging; returns it as a contiguous CPU tensor (copying only if needed)."""
    if not isinstance(payload, torch.Tensor):
        raise transfer_failed(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    dtype_name(payload.dtype)
    if payload.device.type != "cpu":
        payload = payload.to("cpu")
    return payload.contiguous()


def check_blocks(kv_cache: torch.Tensor, block_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a block-major cache [num_blocks, ...] on any device and block ids; returns
    (cache, ids as int64 [n] on the host)."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() < 1 or not kv_cache.is_contiguous():
        raise transfer_failed("kv_cache must be a contiguous tensor [num_blocks, ...]")
    dtype_name(kv_cache.dtype)
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu").reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv_cache.shape[0]):
        raise transfer_failed(f"block ids out of range [0, {kv_cache.shape[0]})")
    return kv_cache, ids


def host_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for two contiguous host tensors of the same bytes: one memcpy on the calling thread.

    Host copies here never use torch: its copy would start an OpenMP thread pool of the calling thread's own
    (the event loop, an executor thread), and a second pool in a worker process slows every engine step
    (``shared/engine/async_engine.py``). numpy copies on this thread alone and releases the GIL."""
    _check_contiguous(dst, src)
    np.copyto(as_bytes(dst).numpy(), as_bytes(src).numpy(), casting="no")


def _check_contiguous(*tensors: torch.Tensor) -> None:
    """Byte views of these must be views (``as_bytes`` of a strided tensor would be a copy, and writes lost)."""
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("host copies need contiguous tensors")


def gather_blocks_into(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = cache[ids]`` with ``out`` host staging [n, *block_shape]; one copy into ``out`` either way:
    a CPU cache is gathered straight into it on the calling thread (as ``host_copy_``), a device cache through
    ``gather_via_device``. ``ids`` are in range (``check_blocks``)."""
    if cache.device.type == "cpu":
        _check_contiguous(cache, out)
        if not ids.numel():
            return out
        rows = as_bytes(cache).numpy().reshape(cache.shape[0], -1)           # [num_blocks, block bytes]
        np.take(rows, ids.numpy(), axis=0, out=as_bytes(out).numpy().reshape(ids.numel(), -1), mode="clip")
        return out
    return gather_via_device(cache, ids, out)


def gather_via_device(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Gather on the cache's device, then exactly one copy to ``out`` (returns when the bytes are there)."""
    blocks = cache.index_select(0, ids.to(cache.device))      # [n, *block_shape] on the cache's device
    out.copy_(blocks)                                          # the one device -> host copy (synchronous)
    return out


async def host_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]`` as a new contiguous CPU tensor [n, *block_shape]: a CPU cache is gathered on the
    loop (one copy); a device cache through ``gather_via_device`` (in a worker thread when big)."""
    out = torch.empty((int(ids.numel()), *cache.shape[1:]), dtype=cache.dtype)   # [n, *block_shape]
    if cache.device.type == "cpu":
        return gather_blocks_into(cache, ids, out)
    if out.numel() * out.element_size() >= THREAD_COPY_BYTES:
        await in_thread(gather_via_device, cache, ids, out)
    else:
        gather_via_device(cache, ids, out)
    return out


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a worker thread; a cancelled caller still waits for the thread to end
    (then re-raises), so memory the thread touches is never freed or unmapped under it."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


def write_parts(dst: torch.Tensor, parts: list) -> None:
    """``dst`` (uint8, contiguous host) <- the bytes of ``parts`` one after another; ``transfer_failed`` unless
    they fill it exactly."""
    view, start = dst.numpy(), 0
    for part in parts:
        n = len(part)
        if start + n > view.size:
            raise transfer_failed(f"parts of more than {view.size} B do not fit the payload")
        view[start:start + n] = np.frombuffer(part, dtype=np.uint8)
        start += n
    if start != view.size:
        raise transfer_failed(f"parts of {start} B do not fill a payload of {view.size} B")


def transfer_timeout(base_s: float, nbytes: int) -> float:
    """A wait for moving ``nbytes``: ``base_s`` plus the time the slowest planned link takes for them
    (``MIN_TRANSFER_BYTES_PER_S``; 77K tokens of a 0.5B model's fp32 KV, 1.9 GB: 19 s more)."""
    return base_s + max(0, nbytes) / MIN_TRANSFER_BYTES_PER_S


def handle_meta(handle: dict) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, nbytes) from a handle, validated against each other."""
    if not isinstance(handle, dict):
        raise transfer_failed(f"KV handle must be a dict, got {type(handle).__name__}")
    try:
        dtype = parse_dtype(handle["dtype"])
        shape = [int(s) for s in handle["shape"]]
        nbytes = int(handle["nbytes"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise transfer_failed(f"malformed KV handle: {exc!r}") from None
    numel = 1
    for s in shape:
        if s < 0:
            raise transfer_failed(f"negative dimension in KV handle shape {shape}")
        numel *= s
    expect = numel * torch.empty((), dtype=dtype).element_size()
    if expect != nbytes:
        raise transfer_failed(f"KV handle nbytes {nbytes} != {expect} for {handle['dtype']}{shape}")
    return dtype, shape, nbytes


def output_tensor(handle: dict, out: torch.Tensor | None) -> torch.Tensor:
    """The tensor ``fetch`` fills: ``out`` when it matches the handle (dtype, shape, contiguous CPU), else new."""
    dtype, shape, _ = handle_meta(handle)
    if out is not None:
        if out.dtype == dtype and list(out.shape) == shape and out.is_contiguous() and out.device.type == "cpu":
            return out
        log.debug("fetch: out %s%s does not match handle %s%s; allocating", out.dtype, list(out.shape), dtype, shape)
    return torch.empty(shape, dtype=dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (no copy). [*] -> [nbytes]"""
    return t.reshape(-1).view(torch.uint8)


class StagingBudget:
    """Bytes currently staged by one sender, bounded by ``max_bytes``; ``acquire`` waits up to ``timeout``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.used = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def acquire(self, nbytes: int, timeout: float) -> None:
        if nbytes > self.max_bytes:
            raise transfer_failed(f"payload of {nbytes} B exceeds max_staged_bytes={self.max_bytes}")
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.used + nbytes <= self.max_bytes), timeout)
            except asyncio.TimeoutError:
                raise transfer_failed(f"staging full: {self.used} of {self.max_bytes} B in use, "
                                      f"{nbytes} B more did not fit within {timeout:.1f} s") from None
            self.used += nbytes

    async def release(self, nbytes: int) -> None:
        cond = self._condition()
        async with cond:
            self.used = max(0, self.used - nbytes)
            cond.notify_all()


class KVTransport(abc.ABC):
    """Moves one contiguous KV payload from a sender (``stage``/``release``) to a receiver (``fetch``).

    One instance per worker may act as sender and receiver at once. Subclasses keep per-transfer state keyed
    by ``transfer_id``; ids must be unique among a sender's live transfers.
    """

    name: str = "?"

    def __init__(self, nc: Any, worker_id: str, *, max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
                 stage_timeout: float = DEFAULT_STAGE_TIMEOUT) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.stage_timeout = stage_timeout
        self.budget = StagingBudget(max_staged_bytes)
        self.closed = False
        self._staged: dict[str, Any] = {}  # transfer id -> the subclass's staging record

    @property
    def staged_bytes(self) -> int:
        """Payload bytes staged and not yet released."""
        return self.budget.used

    @abc.abstractmethod
    async def stage(self, payload: torch.Tensor, transfer_id: str) -> dict:
        """Sender: make ``payload`` ([n, *block_shape], any shape) fetchable; return its handle."""

    async def stage_blocks(self, kv_cache: torch.Tensor, block_ids, transfer_id: str) -> dict:
        """Sender: stage ``kv_cache[block_ids]`` (cache [num_blocks, *block_shape] -> payload [n, ...]).

        Same handle and contract as ``stage``; transports override it to gather straight into their staging
        (shm) or to read the blocks in place (nixl), skipping the intermediate payload tensor. The blocks must
        not be modified until ``release``. Here: the gathered host payload (``host_blocks``) is staged as is.
        """
        cache, ids = check_blocks(kv_cache, block_ids)      # [num_blocks, *block_shape], [n]
        return await self.stage(await host_blocks(cache, ids), transfer_id)

    async def stage_parts(self, parts: list, dtype: torch.dtype, shape: list[int], transfer_id: str) -> dict:
        """Sender: stage the concatenation of ``parts`` (bytes-like, in order) as one payload of ``shape`` /
        ``dtype`` (a cache tier's stored blocks). Same handle and contract as ``stage``; shm writes the parts
        straight into its segment (no payload tensor). Here: they are joined into one tensor, then staged."""
        payload = torch.empty(shape, dtype=dtype)
        await in_thread(write_parts, as_bytes(payload), parts)
        return await self.stage(payload, transfer_id)

    @abc.abstractmethod
    async def fetch(self, handle: dict, out: torch.Tensor | None = None, timeout: float = 10.0) -> torch.Tensor:
        """Receiver: the staged tensor (dtype/shape from the handle); filled into ``out`` when it matches."""

    @abc.abstractmethod
    async def release(self, transfer_id: str) -> None:
        """Sender: free the staging of ``transfer_id``. Idempotent; unknown ids are ignored."""

    async def close(self) -> None:
        """Release everything this instance staged and drop receiver-side caches. Idempotent."""
        self.closed = True

    def _fetch_target(self, handle: dict, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """A fetch's first step: ``(the tensor the payload lands in, its byte count)``; raises when closed or when
        the handle's dtype / shape / nbytes disagree (``output_tensor``)."""
        self._check_open()
        return output_tensor(handle, out), int(handle["nbytes"])

    async def _close_staged(self) -> bool:
        """Mark closed and release every staged transfer; False (nothing done) when already closed."""
        if self.closed:
            return False
        self.closed = True
        for tid in list(self._staged):
            await self.release(tid)
        return True

    def _check_open(self) -> None:
        if self.closed:
            raise transfer_failed(f"{self.name} transport of {self.worker_id} is closed")

    def _check_new(self, transfer_id: str) -> None:
        """Transfer ids are unique among this sender's live transfers (subclasses keep ``_staged``)."""
        if transfer_id in self._staged:
            raise transfer_failed(f"transfer {transfer_id!r} is already staged")

    async def _reserve(self, transfer_id: str, nbytes: int) -> None:
        """Wait for ``nbytes`` of staging room for a new transfer; re-check the id afterwards, since another
        ``stage`` of the same id may have won while we waited (the room is given back then)."""
        self._check_new(transfer_id)
        await self.budget.acquire(nbytes, self.stage_timeout)
        if transfer_id in self._staged:
            await self.budget.release(nbytes)
            self._check_new(transfer_id)


def handle_fields(handle: dict, transport: str, **kinds: Callable[[Any], Any]) -> tuple:
    """The handle's transport-specific fields, each converted by its ``kind`` (``str``, ``int``, ``bytes``…);
    a missing or mistyped field is ``transfer_failed`` naming the transport."""
    try:
        return tuple(kind(handle[name]) for name, kind in kinds.items())
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise transfer_failed(f"malformed {transport} handle: {exc!r}") from None


def deadline_left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


async def sync_with_server(nc: Any, timeout: float) -> None:
    """Return once the server has processed every SUB/UNSUB this client sent before the call: a message to
    our own inbox is queued behind them and comes back through the server. Raises ``TimeoutError`` (nats')
    after ``timeout``; safe to cancel.

    Not ``nc.flush()``: nats-py 2.16 resolves a PONG into the flush's future even when a timeout or a cancel
    already cancelled it; the ``InvalidStateError`` ends the client's read loop and the connection stays deaf
    until a stale-connection reconnect (~15 s, messages lost). It also writes PING ahead of pending SUB/UNSUB.
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    try:
        await nc.publish(inbox, b"")
        await sub.next_msg(timeout=timeout)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def unsubscribe_quietly(nc: Any, sub: Any, timeout: float = 1.0) -> None:
    """Unsubscribe and make the server forget the interest now, so pullers of a released transfer get
    "no responders" at once instead of a timeout. Errors (connection closed) are only logged."""
    try:
        await sub.unsubscribe()
        await sync_with_server(nc, timeout)
    except Exception as exc:  # noqa: BLE001 - a closed connection has no subscriptions left anyway
        log.debug("unsubscribe %s: %r", getattr(sub, "subject", "?"), exc)
