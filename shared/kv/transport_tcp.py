"""``tcp`` KV transport (any host, no extra library): the receiver reads the payload straight from the sender over
one TCP connection, with no broker in the path (``stream`` relays every byte through the NATS server).

Handle: {"transport": "tcp", "host": the sender's advertised address, "port", "token": 32 hex chars,
"nbytes", "dtype", "shape"}. Wire: the receiver connects and sends the token (32 ASCII bytes); the sender
answers one status byte, ``1`` then exactly ``nbytes`` payload bytes, or ``0`` then a short UTF-8 reason,
and closes.

Invariants:
- Zero copies beyond the kernel's: the sender ``sock_sendall``s a memoryview of the staged payload, the receiver
  ``sock_recv_into``s the output tensor's memory.
- The token is a fresh 128-bit secret per staged transfer: only a holder of the handle (which travels inside
  NATS messages that the permissions confine) can read the payload. An unknown or released token is refused
  at once (fast failure, as ``stream``'s "no responders").
- Every wait is bounded: connect + read by the fetch's ``timeout``; the sender's token read by
  ``TOKEN_TIMEOUT_S``, a send by ``SEND_TIMEOUT_S``; at most ``MAX_CONNECTIONS`` served at once (more are
  refused with a reason).
- The listener (``0.0.0.0``, an ephemeral port unless ``port`` is given) starts with the first ``stage``; the
  advertised address is ``advertise`` if given, else the local address this host uses to reach its first
  non-loopback NATS server (no packet is sent to find it), else ``127.0.0.1`` (one host).
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket

import torch

from shared.kv.transport import (KVTransport, as_bytes, check_payload, dtype_name, handle_fields,
                                 transfer_failed)

log = logging.getLogger(__name__)

TOKEN_BYTES = 32           # hex characters
TOKEN_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 64
OK, REFUSED = b"\x01", b"\x00"


def advertise_address(nc) -> str:
    """The local address this host reaches its first non-loopback NATS server from (UDP connect: no traffic)."""
    for server in getattr(nc, "servers", None) or []:   # nats-py: parsed URLs (or Srv objects holding one)
        host = getattr(getattr(server, "uri", server), "hostname", None) or ""
        try:
            if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                return probe.getsockname()[0]
        except (OSError, ValueError):
            continue
    return "127.0.0.1"


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, nc, worker_id: str, *, advertise: str = "", port: int = 0, **kwargs) -> None:
        super().__init__(nc, worker_id, **kwargs)
        self.advertise, self.port = advertise, port
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._serving: set[asyncio.Task] = set()
        self._by_token: dict[str, str] = {}      # token -> transfer id

    # ---------------------------------------------------------------- sender
    async def _listen(self) -> None:
        if self._listener is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener, self.port = sock, sock.getsockname()[1]
        self.advertise = self.advertise or advertise_address(self.nc)
        self._accepting = asyncio.ensure_future(self._accept_loop())
        log.info("tcp KV transport of %s listens on port %d (advertised %s)", self.worker_id, self.port,
                 self.advertise)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            task = asyncio.ensure_future(self._serve(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                if len(self._serving) > MAX_CONNECTIONS:
                    raise LookupError(f"{self.worker_id} serves {MAX_CONNECTIONS} transfers already")
                token = await asyncio.wait_for(self._read_token(loop, conn), TOKEN_TIMEOUT_S)
                entry = self._staged.get(self._by_token.get(token, ""))
                if entry is None:
                    raise LookupError("unknown or released transfer")
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.wait_for(loop.sock_sendall(conn, OK), SEND_TIMEOUT_S)
                await asyncio.wait_for(loop.sock_sendall(conn, entry["view"]), SEND_TIMEOUT_S)
            except LookupError as err:
                with contextlib.suppress(OSError):
                    await asyncio.wait_for(loop.sock_sendall(conn, REFUSED + str(err).encode()[:200]), 1.0)
            except (OSError, asyncio.TimeoutError) as err:
                log.info("tcp: a transfer connection failed: %r", err)

    @staticmethod
    async def _read_token(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> str:
        data = b""
        while len(data) < TOKEN_BYTES:
            chunk = await loop.sock_recv(conn, TOKEN_BYTES - len(data))
            if not chunk:
                raise LookupError("no token")
            data += chunk
        return data.decode("ascii", errors="replace")

    async def stage(self, payload: torch.Tensor, transfer_id: str) -> dict:
        self._check_open()
        payload = check_payload(payload)                       # [n, *block_shape] contiguous CPU
        nbytes = payload.numel() * payload.element_size()
        await self._reserve(transfer_id, nbytes)
        try:
            await self._listen()
        except OSError as exc:
            await self.budget.release(nbytes)
            raise transfer_failed(f"tcp: cannot listen: {exc!r}") from exc
        token = secrets.token_hex(TOKEN_BYTES // 2)
        view = memoryview(as_bytes(payload).numpy()).cast("B")
        self._staged[transfer_id] = {"payload": payload, "view": view, "token": token, "nbytes": nbytes}
        self._by_token[token] = transfer_id
        return {"transport": self.name, "host": self.advertise, "port": self.port, "token": token,
                "nbytes": nbytes, "dtype": dtype_name(payload.dtype), "shape": list(payload.shape)}

    async def release(self, transfer_id: str) -> None:
        entry = self._staged.pop(transfer_id, None)
        if entry is None:
            return
        self._by_token.pop(entry["token"], None)
        await self.budget.release(entry["nbytes"])

    # ---------------------------------------------------------------- receiver
    async def fetch(self, handle: dict, out: torch.Tensor | None = None, timeout: float = 10.0) -> torch.Tensor:
        result, nbytes = self._fetch_target(handle, out)
        host, port, token = handle_fields(handle, "tcp", host=str, port=int, token=str)
        if len(token) != TOKEN_BYTES or not 0 < port < 65536:
            raise transfer_failed("malformed tcp handle: bad token or port")
        if nbytes == 0:
            return result
        dst = memoryview(as_bytes(result).numpy()).cast("B")  # the output's own memory
        try:
            await asyncio.wait_for(self._read(host, port, token, dst, nbytes), timeout)
        except asyncio.TimeoutError:
            raise transfer_failed(f"tcp fetch from {host}:{port} exceeded {timeout:.1f} s") from None
        except OSError as exc:
            raise transfer_failed(f"tcp fetch from {host}:{port}: {exc!r}") from exc
        return result

    @staticmethod
    async def _read(host: str, port: int, token: str, dst: memoryview, nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, token.encode("ascii"))
            status = await loop.sock_recv(sock, 1)
            if status != OK:
                reason = (await loop.sock_recv(sock, 256)).decode(errors="replace") if status else "closed"
                raise transfer_failed(f"tcp sender {host}:{port} refused: {reason}")
            got = 0
            while got < nbytes:
                n = await loop.sock_recv_into(sock, dst[got:nbytes])
                if not n:
                    raise transfer_failed(f"tcp sender {host}:{port} closed after {got} of {nbytes} B")
                got += n

    async def close(self) -> None:
        if not await self._close_staged():
            return
        tasks = [t for t in (self._accepting, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
