"""``cuda_ipc``: KV blocks between two processes on one host, GPU to GPU, with CUDA IPC memory handles.

The sender gathers the blocks into a device tensor it keeps alive until ``release`` and puts the storage's
IPC handle (torch's ``_share_cuda_`` tuple, bytes and ints) in the hand-off header; the receiver opens the
handle, copies the bytes into its own tensor on its device, and closes it. No host round trip:
``stage_blocks`` of a CUDA cache gathers on the cache's device straight into the staged tensor (one copy);
a CPU cache is gathered on the host and moved to the device (``stage``).

Invariants: the staged tensor is never modified or freed before ``release`` and its bytes are complete
(its device's stream synchronized) before a handle is returned; the receiver's copy completes
(``torch.cuda.synchronize`` on its stream) before ``fetch`` returns, so the sender may release right after the
ack. Usable only where CUDA is available (``available()`` says so); the module imports anywhere.
"""
from __future__ import annotations

import asyncio
import math
import time

import torch

from shared.kv.transport import KVTransport, check_blocks, dtype_name, handle_meta, transfer_failed


def available() -> bool:
    return torch.cuda.is_available()


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self, nc, worker_id: str, **kwargs) -> None:
        if not available():
            raise transfer_failed("cuda_ipc needs a CUDA device")
        super().__init__(nc, worker_id, **kwargs)
        self._staged: dict[str, torch.Tensor] = {}

    async def stage(self, payload: torch.Tensor, transfer_id: str) -> dict:
        self._check_open()
        self._check_new(transfer_id)
        device_payload = payload.to("cuda", non_blocking=True).contiguous()  # [n, L, 2, kvh, bs, D]
        nbytes = device_payload.numel() * device_payload.element_size()
        await self._reserve(transfer_id, nbytes)
        return self._publish(transfer_id, device_payload)

    async def stage_blocks(self, kv_cache: torch.Tensor, block_ids, transfer_id: str) -> dict:
        """A CUDA cache: ``index_select`` on its device straight into the staged tensor (no host copy)."""
        self._check_open()
        cache, ids = check_blocks(kv_cache, block_ids)        # [num_blocks, *block_shape], [n]
        if not cache.is_cuda:
            return await super().stage_blocks(cache, ids, transfer_id)
        nbytes = int(ids.numel()) * math.prod(cache.shape[1:]) * cache.element_size()
        await self._reserve(transfer_id, nbytes)
        try:
            staged = cache.index_select(0, ids.to(cache.device))   # [n, *block_shape] on the cache's device
        except Exception as exc:  # out of device memory, ...
            await self.budget.release(nbytes)
            raise transfer_failed(f"cuda_ipc: gathering {nbytes} B on {cache.device} failed: {exc!r}") from exc
        return self._publish(transfer_id, staged)

    def _publish(self, transfer_id: str, device_payload: torch.Tensor) -> dict:
        """Keep ``device_payload`` (room already reserved) until ``release``; return its IPC handle."""
        torch.cuda.current_stream(device_payload.device).synchronize()  # bytes exist before the handle does
        self._staged[transfer_id] = device_payload
        nbytes = device_payload.numel() * device_payload.element_size()
        storage = device_payload.untyped_storage()
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
        return {"transport": self.name, "dtype": dtype_name(device_payload.dtype),
                "shape": list(device_payload.shape), "nbytes": nbytes, "device": int(device),
                "ipc": [bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
                        bytes(event_handle or b""), bool(event_sync)],
                "storage_offset": int(device_payload.storage_offset())}

    async def fetch(self, handle: dict, out: torch.Tensor | None = None, timeout: float = 10.0) -> torch.Tensor:
        self._check_open()
        dtype, shape, _ = handle_meta(handle)
        deadline = time.monotonic() + timeout

        def open_and_copy() -> torch.Tensor:
            h, size, offset, ref_h, ref_off, event_h, event_sync = handle["ipc"]
            storage = torch.UntypedStorage._new_shared_cuda(handle["device"], h, size, offset, ref_h, ref_off,
                                                            event_h or None, event_sync)
            remote = torch.empty(0, dtype=dtype, device=f"cuda:{handle['device']}")
            remote.set_(storage, handle["storage_offset"], shape)
            target = out if out is not None and out.is_cuda and list(out.shape) == shape and \
                out.dtype == dtype else torch.empty(shape, dtype=dtype, device="cuda")
            target.copy_(remote)
            torch.cuda.current_stream().synchronize()
            return target

        try:
            return await asyncio.wait_for(asyncio.to_thread(open_and_copy), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise transfer_failed(f"cuda_ipc fetch did not finish within {timeout:.1f} s") from None
        except (RuntimeError, KeyError, ValueError, TypeError) as err:
            raise transfer_failed(f"cuda_ipc handle could not be opened: {err}") from None

    async def release(self, transfer_id: str) -> None:
        tensor = self._staged.pop(transfer_id, None)
        if tensor is not None:
            await self.budget.release(tensor.numel() * tensor.element_size())

    async def close(self) -> None:
        for transfer_id in list(self._staged):
            await self.release(transfer_id)
        await super().close()
