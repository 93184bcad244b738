"""KV hand-off across two simulated hosts (network + UTS namespaces joined by veth through a bridge; as root),
per cross-host transport, beside the link's own ceiling measured in the same run.

Host ``tx`` runs the nats-server and the sender (``benchmarks/kv_transfer.py``'s, which owns a KV cache and stages
scattered blocks); host ``rx`` runs the receiver, which fetches each hand-off into a preallocated buffer. The
ceiling is a raw TCP copy loop between the same two namespaces (``sendall`` of one buffer, ``recv_into`` a
preallocated one, the same bytes per round). Then both hosts' links are shaped (``tc tbf``, ``--rate``) and all
of it runs again. Reported: GB/s per path (median of ``--rounds``), whole hand-off and fetch alone, and each
one's ratio to the ceiling.

    python -m benchmarks.cross_host_kv [--transports stream,nixl] [--mib 64] [--rounds 5] [--rate 10gbit]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_transfer import MIB, run_transport
from shared.nats_auth import render_server_config
from shared.nats_server import find_nats_server
from tests.cluster.netns import SimulatedHosts

ROOT = Path(__file__).resolve().parents[1]
TCP_PORT, NATS_PORT = 5201, 4222
log = logging.getLogger("bench.cross_host")
# The simulated hosts share one kernel: UCX would find that out and move nixl's bytes through shared memory
# (faster than the link). Real hosts cannot, so UCX is held to TCP, i.e. to the veth link being measured.
SIMULATED_HOST_ENV = {**os.environ, "UCX_TLS": "tcp"}


def tcp_serve(total: int, rounds: int) -> None:
    """Sender side of the ceiling: per connection, send ``total`` bytes ``rounds`` times."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (total >> 20))
    with socket.create_server(("0.0.0.0", TCP_PORT)) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                conn.recv(1)                      # the receiver asks for a round
                conn.sendall(payload)


def tcp_receive(host: str, total: int, rounds: int) -> float:
    """Median seconds per ``total`` bytes, request to last byte."""
    buf = memoryview(bytearray(total))
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, TCP_PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    times = []
    with conn:
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < total:
                n = conn.recv_into(buf[got:])
                if not n:
                    raise RuntimeError("TCP ceiling: connection closed early")
                got += n
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] if len(times) > 1 else times)


def receiver(args: argparse.Namespace) -> None:
    """Runs inside ``rx``: prints one JSON object, the ceiling's seconds (``--transports raw-tcp``) or the one
    transport's row."""
    total = args.mib * MIB
    if args.transports == "raw-tcp":
        sys.stdout.write(json.dumps({"tcp_s": tcp_receive(args.tx_addr, total, args.rounds + 1)}) + "\n")
        return
    url = f"nats://{args.tx_addr}:{NATS_PORT}"
    rows = asyncio.run(run_transport(url, args.transports, [1 << 20], total, args.rounds, 1,
                                     transport_options(args.transports, total), spawn_sender=False,
                                     modes=("blocks",)))
    sys.stdout.write(json.dumps(rows[0]) + "\n")


def transport_options(name: str, total: int) -> dict:
    """The services' defaults (1 MiB chunks, 4 in flight: 4 MiB chunks or 8 in flight measured no better here)."""
    stream = {"chunk_bytes": 1 << 20, "max_inflight": 4}
    return {"max_staged_bytes": 4 * total, **(stream if name == "stream" else {})}


def run_in_rx(hosts: SimulatedHosts, args: argparse.Namespace, what: str) -> dict:
    done = subprocess.run(hosts.command("rx", [sys.executable, "-m", "benchmarks.cross_host_kv", "--receiver",
                                               "--tx-addr", hosts.address("tx"), "--transports", what,
                                               "--mib", str(args.mib), "--rounds", str(args.rounds)]),
                          capture_output=True, text=True, cwd=ROOT, timeout=900, env=SIMULATED_HOST_ENV)
    if done.returncode != 0:
        raise RuntimeError(f"receiver ({what}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_pass(hosts: SimulatedHosts, args: argparse.Namespace, work: Path) -> dict:
    """In ``tx``: nats-server, then per path its sender (the TCP loop, one KV sender per transport) while the
    receiver runs in ``rx``; one sender at a time (they would all answer the same control subjects)."""
    conf = work / "nats.conf"
    conf.write_text(render_server_config(listen=f"0.0.0.0:{NATS_PORT}", max_payload="8MB"))
    total, py = args.mib * MIB, sys.executable
    url = f"nats://{hosts.address('tx')}:{NATS_PORT}"
    server = hosts.popen("tx", [find_nats_server(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    result: dict = {"rows": []}
    try:
        for what in ["raw-tcp", *args.transports.split(",")]:
            code = (f"from benchmarks.cross_host_kv import tcp_serve; tcp_serve({total}, {args.rounds + 1})"
                    if what == "raw-tcp" else "from benchmarks.kv_transfer import sender_main; "
                    f"sender_main({url!r}, {what!r}, {transport_options(what, total)!r})")
            sender = hosts.popen("tx", [py, "-c", code], cwd=ROOT, env=SIMULATED_HOST_ENV)
            try:
                out = run_in_rx(hosts, args, what)
            finally:
                sender.kill()
                sender.wait(10)
            if what == "raw-tcp":
                result["tcp_s"] = out["tcp_s"]
            else:
                result["rows"].append(out)
    finally:
        server.kill()
        server.wait(10)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="stream,tcp,nixl")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", default="10gbit", help="the shaped pass's link rate (tc tbf on both hosts)")
    ap.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tx-addr", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.receiver:
        receiver(args)
        return
    import tempfile

    total = args.mib * MIB
    results = {}
    with SimulatedHosts(["tx", "rx"]) as hosts, tempfile.TemporaryDirectory() as tmp:
        results["veth"] = one_pass(hosts, args, Path(tmp))
        hosts.shape("tx", rate=args.rate)
        hosts.shape("rx", rate=args.rate)
        results[f"veth, tbf {args.rate}"] = one_pass(hosts, args, Path(tmp))
    print(f"\nKV hand-off across two simulated hosts, {args.mib} MiB fp16 of 1 MiB blocks per hand-off "
          f"(stage_blocks), {os.cpu_count()} CPUs; medians of {args.rounds} rounds")
    print("hand-off = the sender stages (gathers) the blocks + the handle over NATS + the receiver's fetch; "
          "fetch = the receiver's fetch alone (the bytes on the wire)")
    hdr = f"{'link':<22}{'path':<24}{'ms':>9}{'GB/s':>8}{'vs TCP':>8}{'fetch ms':>10}{'fetch GB/s':>12}{'vs TCP':>8}"
    print(hdr)
    print("-" * len(hdr))
    for link, res in results.items():
        tcp = total / res["tcp_s"] / 1e9
        print(f"{link:<22}{'raw TCP (ceiling)':<24}{res['tcp_s'] * 1e3:9.1f}{tcp:8.2f}{1.0:8.2f}")
        for row in res["rows"]:
            gbs, fetch = total / row["hand"] / 1e9, total / row["fetch"] / 1e9
            print(f"{link:<22}{row['transport'] + ' hand-off':<24}{row['hand'] * 1e3:9.1f}{gbs:8.2f}{gbs / tcp:8.2f}"
                  f"{row['fetch'] * 1e3:10.1f}{fetch:12.2f}{fetch / tcp:8.2f}")


if __name__ == "__main__":
    main()
