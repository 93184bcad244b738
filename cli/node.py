"""``deepinfer node``: one host's part of a multi-host deepinfer cluster, in the foreground (Ctrl-C stops it).

It starts this host's nats-server as one node of a NATS cluster (routes to the nodes named by ``--join``, the
same users and permissions on every node from one ``--passwords-file``), then the services named for this host
(``--router``, ``--prefill N``, ``--decode N``, ``--cache-tier N``, ``--draft local|remote``). Services connect to the
local node first and to the other nodes' client URLs after it, so when the local node dies they reconnect to
another one and keep their subscriptions. ``deepinfer up`` is the one-host case of the same launcher.

Service ids carry the node's name (``decode-<name>-0``): unique across the cluster. Workers use this host's
cache tier when it runs one, else the tier named by ``--tier`` (e.g. ``cache-<other host>-0``), else none.

Example (3 hosts; ``python -m shared.nats_auth env --monitor --cluster > cluster.env`` once, copied to each):

    hostA$ deepinfer node --name a --join hostB,hostC --passwords-file cluster.env --router --http-host 0.0.0.0
    hostB$ deepinfer node --name b --join hostA,hostC --passwords-file cluster.env --prefill 1 --cache-tier 1
    hostC$ deepinfer node --name c --join hostA,hostB --passwords-file cluster.env --decode 2 --tier cache-b-0
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from cli import up as cli_up
from cli.flags import add_cluster_flags, add_nats_url, cluster_flag_values, deprecated
from shared import nats_auth
from cli.cluster_spec import ClusterSpec
from shared.nats_cluster import DEFAULT_ROUTE_PORT, ROUTE_USER, NatsClusterNode, route_url

NATS_CLIENT_PORT = 4222


def add_parser(sub) -> None:
    node = sub.add_parser("node", help="one host's part of a multi-host cluster: a NATS node + this host's services")
    node.add_argument("--name", default=socket.gethostname().split(".")[0],
                      help="this node's name: the NATS server name and part of every service id (default: hostname)")
    node.add_argument("--join", default="", metavar="HOST[:PORT],...",
                      help="route addresses of the other NATS nodes (port 6222 by default)")
    add_nats_url(node, "where this host's NATS node listens for clients (its routes: --route-port)",
                 default=f"nats://0.0.0.0:{NATS_CLIENT_PORT}")
    deprecated(node, "--nats-host", "--nats-url nats://HOST:PORT", "nats_host")
    deprecated(node, "--nats-port", "--nats-url nats://HOST:PORT", "nats_port", type=int)
    node.add_argument("--route-port", type=int, default=DEFAULT_ROUTE_PORT, help="its route port")
    node.add_argument("--store-dir", default=None, help="its JetStream directory (default: a temporary one)")
    node.add_argument("--log-dir", default="", help="the services' log files (default: a temporary directory)")
    node.add_argument("--registry-replicas", type=int, default=0,
                      help="replicas of the registry bucket (default: the node count, at most 3)")
    auth = node.add_mutually_exclusive_group(required=True)
    auth.add_argument("--passwords-file", metavar="FILE",
                      help="NATS_PASSWORD_<USER>=... lines, the same on every node "
                           "(python -m shared.nats_auth env --monitor --cluster)")
    auth.add_argument("--no-auth", action="store_true", help="no NATS users at all (a closed test network only)")
    node.add_argument("--router", action="store_true", help="run a router (OpenAI HTTP + NATS API) here")
    node.add_argument("--prefill", type=int, default=0)
    node.add_argument("--decode", type=int, default=0)
    node.add_argument("--cache-tier", type=int, default=0, metavar="N", help="cache tier services to run here")
    node.add_argument("--tier", default="", metavar="ID",
                      help="the cache tier this host's workers use when it runs none (e.g. cache-b-0)")
    add_cluster_flags(node)


def peer_client_urls(join: list[str], nats_port: int) -> list[str]:
    """Client URLs of the joined nodes: their route hosts at the client port (every node uses the same port)."""
    hosts = [urllib.parse.urlsplit(route_url(j)).hostname for j in join]
    return [f"nats://{h}:{nats_port}" for h in hosts]


def node_spec(args: argparse.Namespace, emit: Callable[..., None] = print) -> ClusterSpec:
    """The ``ClusterSpec`` of this host's part (``ValueError`` for a bad combination)."""
    join = [j.strip() for j in args.join.split(",") if j.strip()]
    listen = urllib.parse.urlsplit(args.nats_url if "://" in args.nats_url else f"nats://{args.nats_url}")
    nats_host = getattr(args, "nats_host", None) or listen.hostname or "0.0.0.0"
    nats_port = getattr(args, "nats_port", None) or listen.port or NATS_CLIENT_PORT
    passwords = {} if args.no_auth else nats_auth.read_passwords(Path(args.passwords_file).read_text())
    if passwords and ROUTE_USER not in passwords:
        raise ValueError("the passwords file has no NATS_PASSWORD_ROUTE (python -m shared.nats_auth env --cluster)")
    # no --join: a node of its own (nats-server refuses clustered JetStream without routes); `up` does the same
    cluster = NatsClusterNode(server_name=args.name, listen=f"{nats_host}:{args.route_port}",
                              routes=tuple(join), route_password=passwords.get(ROUTE_USER, "")) if join else None
    replicas = args.registry_replicas or min(3, 1 + len(join))
    return ClusterSpec(prefill=args.prefill, decode=args.decode, model=args.model or "", **cluster_flag_values(args),
                       draft=cli_up.draft_spec(args, emit), http_host=args.http_host,
                       http_port=args.http_port if args.router else -1,
                       auth=bool(passwords), passwords=passwords, router=args.router, name=args.name,
                       nats_host=nats_host, nats_port=nats_port, nats_cluster=cluster,
                       nats_peers=peer_client_urls(join, nats_port), tier_id=args.tier,
                       registry_replicas=replicas, nats_store_dir=args.store_dir or "", log_dir=args.log_dir)


def run(args: argparse.Namespace, emit: Callable[..., None] = print) -> int:
    """``deepinfer node``; everything shown goes through ``emit``."""
    try:
        spec = node_spec(args, emit)
    except (ValueError, OSError) as err:
        emit(f"deepinfer: error: {err}", file=sys.stderr)
        return 2
    args.demo = args.exit_after_demo = False
    return asyncio.run(cli_up.serve(args, spec, emit))
