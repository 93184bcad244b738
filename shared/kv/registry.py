"""The KV transport registry: which transports exist, which are usable here, and how to build one.

Invariants:
- Names are ``shm``, ``stream``, ``tcp``, ``nixl`` and ``cuda_ipc``; ``available_transports()`` keeps this
  order and lists ``shm``, ``stream`` and ``tcp`` always (services prefer what their ``transports`` config says).
- Importing this module is cheap and cycle-free: the transport modules import only the base
  (``shared.kv.transport``), never this registry; the NIXL library and CUDA are probed only when
  ``available_transports``/``make_transport`` is called.
- An unknown name is INVALID_REQUEST; a known one not usable here is TRANSFER_FAILED.
"""
from __future__ import annotations

from typing import Any, Callable

from shared.errors import DeepinferError, ErrorCode
from shared.kv import transport_cuda_ipc, transport_nixl
from shared.kv.transport import KVTransport, transfer_failed
from shared.kv.transport_cuda_ipc import CudaIpcTransport
from shared.kv.transport_nixl import NixlTransport
from shared.kv.transport_shm import ShmTransport
from shared.kv.transport_stream import StreamTransport
from shared.kv.transport_tcp import TcpTransport

_FACTORIES: dict[str, Callable[..., KVTransport]] = {
    "shm": ShmTransport, "stream": StreamTransport, "tcp": TcpTransport, "nixl": NixlTransport,
    "cuda_ipc": CudaIpcTransport,
}

_AVAILABLE: dict[str, Callable[[], bool]] = {
    "shm": lambda: True, "stream": lambda: True, "tcp": lambda: True, "nixl": transport_nixl.nixl_available,
    "cuda_ipc": transport_cuda_ipc.available,
}


def available_transports() -> list[str]:
    """Transports usable in this process: ``shm``, ``stream`` and ``tcp`` always, ``nixl`` when its library imports,
    ``cuda_ipc`` when CUDA is available."""
    return [name for name, ok in _AVAILABLE.items() if ok()]


def make_transport(name: str, nc: Any, worker_id: str, **kwargs: Any) -> KVTransport:
    """Build transport ``name`` for ``worker_id`` on NATS connection ``nc`` (kwargs: transport options)."""
    if name not in _FACTORIES:
        raise DeepinferError(ErrorCode.INVALID_REQUEST,
                             f"unknown KV transport {name!r}; known: {sorted(_FACTORIES)}")
    if not _AVAILABLE[name]():
        raise transfer_failed(f"KV transport {name!r} is not available here "
                              f"(available: {available_transports()})")
    return _FACTORIES[name](nc, worker_id, **kwargs)
