"""Integration fixtures: a real nats-server (JetStream on, max_payload 8 MB) on a free loopback port.

- ``start_nats_server(port=None, jetstream=True)`` -> ``NatsServerProcess`` (``.url``, ``.stop()``,
  ``.restart()`` on the same port and store dir) for tests that kill/restart the server themselves.
- ``nats_server`` (module scope): one server shared by a test module, stopped at module teardown.
- ``nc``: a connected nats-py client on ``nats_server``, closed at test teardown.
"""
from __future__ import annotations

import nats
import pytest

from shared.nats_server import EmbeddedNatsServer, start_embedded_server

NatsServerProcess = EmbeddedNatsServer


def start_nats_server(port: int | None = None, jetstream: bool = True) -> NatsServerProcess:
    """Start nats-server on ``port`` (None: a free one); returns once it accepts connections (≤ 10 s)."""
    return start_embedded_server(port=port or 0, jetstream=jetstream, timeout=10.0)


@pytest.fixture(scope="module")
def nats_server():
    server = start_nats_server()
    try:
        yield server
    finally:
        server.stop()


async def connect(url: str, **kwargs) -> nats.NATS:
    """A nats-py client with bounded connect time; no reconnect loop hides a dead server in tests."""
    kwargs.setdefault("connect_timeout", 5)
    kwargs.setdefault("max_reconnect_attempts", 2)
    kwargs.setdefault("reconnect_time_wait", 0.2)
    kwargs.setdefault("allow_reconnect", True)
    return await nats.connect(url, **kwargs)


@pytest.fixture
async def nc(nats_server):
    client = await connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def nc2(nats_server):
    """A second, independent connection (e.g. the receiving worker's), closed at test teardown."""
    client = await connect(nats_server.url)
    try:
        yield client
    finally:
        await client.close()
