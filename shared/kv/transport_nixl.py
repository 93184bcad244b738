"""``nixl`` KV transport: the receiver READs the sender's registered payload with NIXL (UCX backend).

Available only when the NIXL Python package imports (``nixl``, or the ``nixl_cu12``/``nixl_cu13`` wheels:
``pip install --no-deps nixl-cu12``); ``nixl_available()`` says so and ``available_transports()`` follows it.

Handle: {"transport": "nixl", "agent": sender agent name, "md": sender agent metadata (bytes),
"addr": payload address in the sender, "subject": control subject, "nbytes", "dtype", "shape"}; from
``stage_blocks`` of a CPU cache also "addrs" (one address per block, in order) and "block_bytes": the
receiver READs the blocks in place from the sender's registered KV cache (zero copies on the sender, no
gather). A device cache is gathered on its device and copied to the host once (``host_blocks``), and that
payload is staged like ``stage``'s (DRAM only: no VRAM registration).

Invariants:
- One NIXL agent per transport instance (unique name), progress thread OFF (3-5x faster on few cores), so
  this class drives progress itself: a background task polls the sender agent while anything is staged
  (``poll_interval``), and ``fetch`` polls ``check_xfer_state`` until DONE/ERR or its deadline.
  All agent calls happen on the event-loop thread (the agent is created with thread sync NONE).
- The sender registers the payload itself (zero copy) and keeps a reference until ``release``, which
  deregisters it; a CPU KV cache passed to ``stage_blocks`` stays registered (and referenced) until ``close``.
  The receiver registers its destination tensor only for the duration of one READ.
- Validity: the sender answers ``{"op": "check"}`` on subjects.kv_pull(...) while the transfer is staged.
  ``fetch`` checks before the READ (fast failure for released/unknown handles: "no responders") and after
  it (the bytes were read while staged, so they are the payload, not reused memory).
- UCX chooses the network interfaces itself (cross-host READs go over whatever links the hosts share);
  ``UCX_NET_DEVICES`` in the environment restricts it (e.g. ``eth0``, or ``mlx5_0:1`` for RDMA).
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import time
import uuid

import msgpack
import torch
from nats import errors as nats_errors

from shared import subjects
from shared.errors import DeepinferError
from shared.kv.transport import (KVTransport, handle_fields, check_blocks, check_payload, dtype_name, host_blocks,
                                 sync_with_server, transfer_failed, unsubscribe_quietly)

log = logging.getLogger(__name__)

_API = None
_IMPORT_ERROR: str | None = None


def _nixl_api():
    """The ``nixl._api`` module (or a CUDA-variant wheel's), or None; the failure reason goes to _IMPORT_ERROR."""
    global _API, _IMPORT_ERROR
    if _API is None and _IMPORT_ERROR is None:
        errors = []
        for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
            try:
                _API = importlib.import_module(mod)
                break
            except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native library
                errors.append(f"{mod}: {exc!r}")
        if _API is None:
            _IMPORT_ERROR = "; ".join(errors)
    return _API


def nixl_available() -> bool:
    return _nixl_api() is not None


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(self, nc, worker_id: str, *, poll_interval: float = 0.0005, check_timeout: float = 2.0,
                 **kwargs) -> None:
        super().__init__(nc, worker_id, **kwargs)
        api = _nixl_api()
        if api is None:
            raise transfer_failed(f"NIXL is not installed or does not load here: {_IMPORT_ERROR}")
        self.poll_interval = poll_interval
        self.check_timeout = check_timeout
        self.agent_name = f"{subjects.safe_token(worker_id)}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(enable_prog_thread=False,
                                                                               backends=[]))
            self.agent.create_backend("UCX", {})
        except Exception as exc:
            raise transfer_failed(f"cannot start a NIXL agent with the UCX backend: {exc!r}") from exc
        self._staged: dict[str, tuple] = {}            # tid -> (payload or cache, own reg or None, sub, nbytes)
        self._cache_regs: dict[tuple[int, int], tuple] = {}   # (ptr, nbytes) -> (kv_cache, reg), until close
        self._remote_md: dict[str, bytes] = {}         # peer agent name -> last metadata loaded
        self._progress_task: asyncio.Task | None = None

    def subject_for(self, transfer_id: str) -> str:
        return subjects.kv_pull(subjects.safe_token(self.worker_id), subjects.safe_token(f"nixl-{transfer_id}"))

    # ---------------------------------------------------------------- sender
    async def stage(self, payload: torch.Tensor, transfer_id: str) -> dict:
        self._check_open()
        payload = check_payload(payload)                       # [n, *block_shape] contiguous CPU
        nbytes = payload.numel() * payload.element_size()
        await self._reserve(transfer_id, nbytes)
        subject = self.subject_for(transfer_id)
        reg = sub = None
        try:
            if nbytes:
                reg = self.agent.register_memory(payload)
            self._staged[transfer_id] = (payload, reg, None, nbytes)
            md = self.agent.get_agent_metadata()
            sub = await self.nc.subscribe(subject, cb=functools.partial(self._serve, transfer_id))
            self._staged[transfer_id] = (payload, reg, sub, nbytes)
            await sync_with_server(self.nc, self.stage_timeout)
        except Exception as exc:
            if transfer_id not in self._staged:
                if reg is not None:
                    self.agent.deregister_memory(reg)
                await self.budget.release(nbytes)
            else:
                await self.release(transfer_id)
            raise transfer_failed(f"cannot stage transfer {transfer_id!r} with NIXL: {exc!r}") from exc
        self._ensure_progress()
        return {"transport": self.name, "agent": self.agent_name, "md": md, "addr": int(payload.data_ptr()),
                "subject": subject, "nbytes": nbytes, "dtype": dtype_name(payload.dtype),
                "shape": list(payload.shape)}

    async def stage_blocks(self, kv_cache: torch.Tensor, block_ids, transfer_id: str) -> dict:
        """Zero copy: register the whole CPU cache once; the receiver READs the n blocks where they are.
        A device cache: one gather on the device + one device -> host copy, staged as a payload."""
        self._check_open()
        cache, ids = check_blocks(kv_cache, block_ids)        # [num_blocks, *block_shape], [n]
        if cache.device.type != "cpu":
            return await self.stage(await host_blocks(cache, ids), transfer_id)
        self._check_new(transfer_id)
        key = (cache.data_ptr(), cache.numel() * cache.element_size())
        if key not in self._cache_regs and key[1]:
            try:
                self._cache_regs[key] = (cache, self.agent.register_memory(cache))
            except Exception as exc:
                raise transfer_failed(f"nixl: cannot register the KV cache: {exc!r}") from exc
        block_bytes = key[1] // max(cache.shape[0], 1)
        nbytes = block_bytes * int(ids.numel())
        await self._reserve(transfer_id, nbytes)  # bounds outstanding transfers, not memory
        subject = self.subject_for(transfer_id)
        self._staged[transfer_id] = (cache, None, None, nbytes)
        try:
            sub = await self.nc.subscribe(subject, cb=functools.partial(self._serve, transfer_id))
            self._staged[transfer_id] = (cache, None, sub, nbytes)
            await sync_with_server(self.nc, self.stage_timeout)
        except Exception as exc:
            await self.release(transfer_id)
            raise transfer_failed(f"cannot stage transfer {transfer_id!r} with NIXL: {exc!r}") from exc
        self._ensure_progress()
        base = cache.data_ptr()
        return {"transport": self.name, "agent": self.agent_name, "md": self.agent.get_agent_metadata(),
                "addr": base, "addrs": [base + int(i) * block_bytes for i in ids.tolist()],
                "block_bytes": block_bytes, "subject": subject, "nbytes": nbytes,
                "dtype": dtype_name(cache.dtype), "shape": [int(ids.numel()), *cache.shape[1:]]}

    async def _serve(self, transfer_id: str, msg) -> None:
        if msg.reply:
            ok = transfer_id in self._staged
            try:
                await self.nc.publish(msg.reply, msgpack.packb({"ok": ok}))
            except Exception as exc:  # noqa: BLE001 - the receiver times out
                log.warning("nixl: check reply for %s failed: %r", transfer_id, exc)

    def _ensure_progress(self) -> None:
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.ensure_future(self._progress())

    async def _progress(self) -> None:
        """Drive the sender agent (no progress thread) while transfers are staged."""
        while self._staged and not self.closed:
            try:
                self.agent.get_new_notifs()            # progresses UCX; the READ notifs themselves are unused
            except Exception as exc:  # noqa: BLE001 - keep driving; receivers time out on real failures
                log.warning("nixl: progress failed: %r", exc)
            await asyncio.sleep(self.poll_interval)

    async def release(self, transfer_id: str) -> None:
        entry = self._staged.pop(transfer_id, None)
        if entry is None:
            return
        _, reg, sub, nbytes = entry
        if sub is not None:
            await unsubscribe_quietly(self.nc, sub)
        if reg is not None:
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:  # noqa: BLE001
                log.warning("nixl: deregister %s: %r", transfer_id, exc)
        await self.budget.release(nbytes)

    # ---------------------------------------------------------------- receiver
    async def _check(self, subject: str, deadline: float, when: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise transfer_failed(f"nixl: deadline passed {when}")
        try:
            msg = await self.nc.request(subject, msgpack.packb({"op": "check"}),
                                        timeout=min(self.check_timeout, left))
            ok = bool(msgpack.unpackb(msg.data).get("ok"))
        except nats_errors.NoRespondersError:
            ok = False
        except Exception as exc:  # noqa: BLE001 - timeout, connection closed, bad reply
            raise transfer_failed(f"nixl: sender check {when} on {subject} failed: {exc!r}") from exc
        if not ok:
            raise transfer_failed(f"nixl: transfer on {subject} is not staged {when} (released or unknown)")

    async def fetch(self, handle: dict, out: torch.Tensor | None = None, timeout: float = 10.0) -> torch.Tensor:
        result, nbytes = self._fetch_target(handle, out)
        if nbytes == 0:
            return result
        peer, md, addr, subject = handle_fields(handle, "nixl", agent=str, md=bytes, addr=int, subject=str)
        deadline = time.monotonic() + timeout
        await self._check(subject, deadline, "before the READ")
        reg = xfer = None
        try:
            if self._remote_md.get(peer) != md:
                loaded = self.agent.add_remote_agent(md)
                if (loaded.decode() if isinstance(loaded, bytes) else str(loaded)) != peer:
                    raise transfer_failed(f"nixl: metadata in the handle is not agent {peer!r}'s")
                self._remote_md[peer] = md
            reg = self.agent.register_memory(result)
            local = self.agent.get_xfer_descs(result)
            if "addrs" in handle:                              # blocks read in place: one descriptor each
                bb = int(handle["block_bytes"])
                if bb * len(handle["addrs"]) != nbytes:
                    raise transfer_failed("nixl handle: addrs x block_bytes != nbytes")
                base = result.data_ptr()
                local = self.agent.get_xfer_descs([(base + j * bb, bb, 0) for j in range(len(handle["addrs"]))],
                                                  "DRAM")
                remote = self.agent.get_xfer_descs([(int(a), bb, 0) for a in handle["addrs"]], "DRAM")
            else:
                remote = self.agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
            xfer = self.agent.initialize_xfer("READ", local, remote, peer, subject.encode())
            state, spins = self.agent.transfer(xfer), 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise transfer_failed(f"nixl: READ of {nbytes} B from {peer} timed out after {timeout:.1f} s")
                spins += 1
                await asyncio.sleep(0 if spins < 64 else self.poll_interval)
                state = self.agent.check_xfer_state(xfer)
            if state != "DONE":
                raise transfer_failed(f"nixl: READ of {nbytes} B from {peer} failed (state {state})")
        except DeepinferError:
            raise
        except Exception as exc:  # noqa: BLE001 - nixl binding errors
            raise transfer_failed(f"nixl: READ from {peer} failed: {exc!r}") from exc
        finally:
            if xfer is not None:
                try:
                    self.agent.release_xfer_handle(xfer)
                except Exception as exc:  # noqa: BLE001 - a stuck transfer cannot always be cancelled
                    log.warning("nixl: releasing transfer handle: %r", exc)
            if reg is not None:
                self.agent.deregister_memory(reg)
        await self._check(subject, deadline, "after the READ")
        return result

    async def close(self) -> None:
        if self.closed:
            return
        for tid in list(self._staged):
            await self.release(tid)
        self.closed = True
        if self._progress_task is not None:
            self._progress_task.cancel()
            await asyncio.gather(self._progress_task, return_exceptions=True)
        for peer in list(self._remote_md):
            try:
                self.agent.remove_remote_agent(peer)
            except Exception as exc:  # noqa: BLE001
                log.debug("nixl: remove_remote_agent %s: %r", peer, exc)
        self._remote_md.clear()
        for _, reg in self._cache_regs.values():
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:  # noqa: BLE001
                log.debug("nixl: deregister cache: %r", exc)
        self._cache_regs.clear()
