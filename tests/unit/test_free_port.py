"""``free_port``: ports the launcher hands to services to listen on come from below the kernel's ephemeral range,
so no outgoing connection can take one between the pick and the service's bind."""
import socket

from shared import nats_server
from shared.nats_server import free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    low = nats_server._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(nats_server, "_ephemeral_low", lambda: 10500)
    assert free_port() > 0
