"""``cuda_ipc``: KV blocks between two processes on one host, GPU to GPU, with CUDA IPC memory handles.

The sender gathers the blocks into a device tensor it keeps alive until ``release`` and puts the storage's
IPC handle (torch's ``_share_cuda_`` tuple, bytes and ints) in the hand-off header; the receiver opens the
handle, copies the bytes into its own tensor on its device, and closes it. No host round trip.

Invariants: the staged tensor is never modified or freed before ``release``; the receiver's copy completes
(``torch.cuda.synchronize`` on its stream) before ``fetch`` returns, so the sender may release right after the
ack. Only importable where CUDA is available; ``available()`` says so.
"""
from __future__ import annotations

import asyncio
import time

import torch

from shared.kv.transport import KVTransport, dtype_name, handle_meta, transfer_failed


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
        torch.cuda.current_stream().synchronize()  # the bytes exist before anyone can open the handle
        self._staged[transfer_id] = device_payload
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
