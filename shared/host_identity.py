"""Which host a service runs on: the one id that decides whether two services may use same-host KV transports
(shared memory, CUDA IPC; ``shared/kv/transport_choice.py``).

Invariants:
- A configured id (the service's ``host_id`` config field, i.e. ``--host-id`` or ``DEEPINFER_HOST_ID``) wins.
- Otherwise the id is ``<hostname>-<8 hex>``, the hex digest over the machine's identity
  (``/etc/machine-id``, else the kernel's boot id) and the UTS hostname. Two hosts, VMs or network-isolated
  simulated hosts (own UTS namespace) therefore never share an id, even when their hostnames are equal on two
  machines; the id is stable across service restarts on one host (and across reboots where ``/etc/machine-id``
  exists).
- Two services share an id only when they share the machine and the hostname. Containers that share a
  hostname but not ``/dev/shm`` (rare: Docker names each container) must be given distinct ``host_id``s;
  containers of one Kubernetes pod share both, and rightly one id.
"""
from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

HOST_ID_ENV = "DEEPINFER_HOST_ID"
_MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id", "/proc/sys/kernel/random/boot_id")


def machine_identity() -> str:
    """The first readable, non-empty machine identity among ``_MACHINE_ID_FILES`` ("" when none is)."""
    for path in _MACHINE_ID_FILES:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return ""


def derive_host_id(hostname: str, machine: str) -> str:
    """``<hostname>-<blake2b(machine, hostname)[:8 hex]>``: readable, and distinct per machine and hostname."""
    digest = hashlib.blake2b(f"{machine}\0{hostname}".encode(), digest_size=4).hexdigest()
    return f"{hostname}-{digest}"


def host_id(configured: str = "") -> str:
    """This process's host id: ``configured``, else ``$DEEPINFER_HOST_ID``, else derived (see module doc)."""
    chosen = configured or os.environ.get(HOST_ID_ENV, "")
    if chosen:
        return chosen
    return derive_host_id(socket.gethostname(), machine_identity())
