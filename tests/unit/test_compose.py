"""compose/: the deployment is valid and every deepinfer service in it starts from a config it accepts.

No Docker engine is needed: ``docker-compose config`` validates and resolves the files (scripts/run_tests.sh
installs docker-compose), then each service's environment and flags go through the same ``load_config`` call
as its ``services/<name>/__main__.py``. Invariants: every ``DEEPINFER_*`` variable is a config field, every
flag parses, the config validates; each service logs in as its own NATS role with that role's password;
scaled services (``--scale prefill=2``) name no container, publish no port and fix no worker id; the nats
container gets every user's password (the roles and ``monitor``), and compose refuses to start without any one.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cache_tier.config import CacheTierConfig

from services.draft.config import DraftConfig

from services.router.config import RouterConfig

from services.worker.config import WorkerConfig

from shared.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
ENV_EXAMPLE = COMPOSE / ".env.example"
ROLES = ("router", "prefill", "decode", "draft", "cache-tier", "client")
USERS = (*ROLES, "monitor")  # nats.conf's users: the roles and the read-only monitor (deepinfer status)
PASSWORD_VARS = tuple(f"NATS_PASSWORD_{u.upper().replace('-', '_')}" for u in USERS)
# The module a service runs -> its config class and what its __main__ fixes (services.worker.base.main_for: role).
CONFIGS = {
    "services.router": (RouterConfig, {}),
    "services.prefill": (WorkerConfig, {"role": "prefill"}),
    "services.decode": (WorkerConfig, {"role": "decode"}),
    "services.cache_tier": (CacheTierConfig, {}),
    "services.draft": (DraftConfig, {}),
}
# ("gpu" would be a pytest keyword: tests/conftest.py skips those on CPU machines)
FILE_SETS = {"cpu": ["docker-compose.yml"], "cuda": ["docker-compose.yml", "docker-compose.gpu.yml"]}


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("docker-compose is not installed: scripts/run_tests.sh installs it with "
                "`apt-get install docker-compose`; that failed or was not run (install Docker Compose by hand)")


def run_config(files: list[str], env_file: Path) -> subprocess.CompletedProcess:
    args = [*compose_command(), "--env-file", str(env_file)]
    for name in files:
        args += ["-f", str(COMPOSE / name)]
    # A bare environment: only the env file decides (no NATS_PASSWORD_* or DEEPINFER_* from the caller).
    return subprocess.run([*args, "config"], capture_output=True, text=True, cwd=COMPOSE, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")})


def read_env_file(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


@pytest.fixture(scope="module", params=sorted(FILE_SETS))
def resolved(request) -> dict:
    """The resolved compose project (interpolated with .env.example), as docker-compose prints it."""
    proc = run_config(FILE_SETS[request.param], ENV_EXAMPLE)
    assert proc.returncode == 0, f"docker-compose config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


MONITORING = ("prometheus", "grafana")   # the `monitoring` profile: not deepinfer's image


def deepinfer_services(project: dict) -> dict[str, dict]:
    return {name: s for name, s in project["services"].items() if name != "nats" and name not in MONITORING}


def test_the_monitoring_profile_scrapes_every_service_and_serves_the_dashboard(resolved):
    """Prometheus and Grafana start only with ``--profile monitoring``; Prometheus scrapes every deepinfer
    service by its compose DNS name at the port it serves /metrics on (the router's HTTP port, the others'
    DEEPINFER_METRICS_PORT); Grafana mounts the provisioning and the dashboard the Kubernetes ConfigMap ships."""
    services = resolved["services"]
    assert all(services[name]["profiles"] == ["monitoring"] for name in MONITORING)
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"]
    targets = {name: sd["port"] for job in scrape for sd in job["dns_sd_configs"] for name in sd["names"]}
    for name, svc in deepinfer_services(resolved).items():
        env = environment(svc)
        want = int(env["DEEPINFER_HTTP_PORT"]) if name == "router" else int(env["DEEPINFER_METRICS_PORT"])
        assert targets.get(name) == want, name
    grafana = {target: COMPOSE / source for source, target, _ in mounts(services["grafana"])}
    assert (grafana["/var/lib/grafana/dashboards"] / "deepinfer-dashboard.json").is_file()
    assert (grafana["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").is_file()


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    return {k: str(v) for k, v in env.items() if v is not None}


def build_config(name: str, service: dict, monkeypatch):
    """The config ``python -m <module> <flags>`` builds in this container (env then flags, as __main__ does)."""
    module, *argv = service["command"]
    assert module in CONFIGS, f"{name}: runs {module!r}, not a deepinfer service"
    cls, fixed = CONFIGS[module]
    env = {k: v for k, v in environment(service).items() if k.startswith("DEEPINFER_")}
    fields = {f"DEEPINFER_{f.name.upper()}" for f in dataclasses.fields(cls)}
    assert not env.keys() - fields, f"{name}: {sorted(env.keys() - fields)} are not fields of {cls.__name__}"
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("DEEPINFER_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        try:
            return load_config(cls, argv, **fixed)
        except SystemExit:
            pytest.fail(f"{name}: {cls.__name__}'s parser rejects the flags {argv}")


@pytest.fixture()
def configs(resolved, monkeypatch) -> dict:
    return {name: build_config(name, s, monkeypatch) for name, s in deepinfer_services(resolved).items()}


def port_targets(service: dict) -> list[int]:
    ports = service.get("ports") or []
    return [int(p["target"]) if isinstance(p, dict) else int(str(p).split("/")[0].rsplit(":", 1)[-1]) for p in ports]


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) for the short ("src:dst:ro") and the long (dict) volume syntax."""
    out = []
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("source", ""), v["target"], bool(v.get("read_only"))))
        else:
            source, target, *mode = v.split(":")
            out.append((source, target, "ro" in mode))
    return out


def test_every_service_is_present_and_runs_through_the_image_entrypoint(resolved):
    assert set(deepinfer_services(resolved)) == {"router", "prefill", "decode", "cache-tier", "draft"}
    assert 'ENTRYPOINT ["python", "-m"]' in (COMPOSE / "Dockerfile").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"compose/.env", ".venv", ".git"} <= set(ignored), "the build context must not carry secrets or the venv"


def test_configs_validate_and_name_their_own_nats_role(resolved, configs):
    passwords = read_env_file(ENV_EXAMPLE)
    nats_env = environment(resolved["services"]["nats"])
    for key in PASSWORD_VARS:  # nats.conf reads every user's password from the nats container's environment
        assert passwords[key] and nats_env[key] == passwords[key], key
    assert {k for k in nats_env if k.startswith("NATS_PASSWORD_")} == set(PASSWORD_VARS)
    users = {name: c.nats_user for name, c in configs.items()}
    assert users == {"router": "router", "prefill": "prefill", "decode": "decode", "cache-tier": "cache-tier",
                     "draft": "draft"}
    for name, c in configs.items():
        assert c.nats_password == passwords[f"NATS_PASSWORD_{c.nats_user.upper().replace('-', '_')}"], name
        assert c.nats_url == "nats://nats:4222", name
    models = {name: c.model for name, c in configs.items() if hasattr(c, "model")}
    assert set(models) == {"router", "prefill", "decode", "draft"} and len(set(models.values())) == 1, \
        f"router, workers and draft must serve one model: {models}"


def test_scaled_services_fix_no_name_port_or_worker_id(resolved, configs):
    services = deepinfer_services(resolved)
    assert not [name for name, s in resolved["services"].items() if "container_name" in s]
    for name in ("prefill", "decode", "draft"):
        assert "DEEPINFER_WORKER_ID" not in environment(services[name]), name
        assert not services[name].get("ports"), f"{name}: a published host port breaks --scale"
    # The id derives from the container's hostname (its container id) plus a random suffix.
    for name in ("prefill", "decode"):
        assert configs[name].worker_id.startswith(f"{name}-{socket.gethostname()}-")


def test_workers_reach_the_cache_tier_and_the_draft_service(resolved, configs):
    tier = configs["cache-tier"]
    assert tier.worker_id and "DEEPINFER_WORKER_ID" in environment(resolved["services"]["cache-tier"])
    volumes = set(resolved.get("volumes") or {})
    tier_mounts = mounts(resolved["services"]["cache-tier"])
    assert any(src in volumes and dst == tier.directory for src, dst, _ in tier_mounts), \
        "the tier's SSD directory must be on a named volume"
    for name in ("prefill", "decode"):
        assert configs[name].cache_tier == tier.worker_id, name
    assert configs["decode"].draft == "remote"


def test_health_checks_probe_the_configured_ports(resolved, configs):
    services = deepinfer_services(resolved)
    router = configs["router"]
    assert router.http_host == "0.0.0.0" and router.http_port in port_targets(services["router"])
    assert f":{router.http_port}/health" in " ".join(services["router"]["healthcheck"]["test"])
    for name in ("prefill", "decode", "cache-tier", "draft"):
        assert configs[name].metrics_port > 0, name
        assert f":{configs[name].metrics_port}/metrics" in " ".join(services[name]["healthcheck"]["test"]), name
    for name, s in services.items():
        assert s["depends_on"]["nats"]["condition"] == "service_healthy", name
        assert s.get("restart") == "unless-stopped", name
    assert "healthcheck" in resolved["services"]["nats"]


def test_nats_runs_compose_nats_conf(resolved):
    nats = resolved["services"]["nats"]
    conf = [(dst, ro) for src, dst, ro in mounts(nats) if Path(src) == COMPOSE / "nats.conf"]
    assert len(conf) == 1 and conf[0][1], "nats must mount compose/nats.conf read-only"
    command = nats["command"]
    assert command[command.index("-c") + 1] == conf[0][0]


def test_nats_conf_matches_the_compose_file():
    path = COMPOSE / "nats.conf"
    if not path.exists():
        pytest.skip("compose/nats.conf is not generated yet (shared/nats_auth.py)")
    text = path.read_text()
    assert re.findall(r'user: "([^"]+)"', text) == list(USERS)
    assert re.findall(r"password: \$(\w+)", text) == list(PASSWORD_VARS)
    assert "/data/jetstream" in text and "8222" in text  # the nats-data volume; the health check's port


def test_passwords_are_required(tmp_path):
    """No default password: every reference is ``${NATS_PASSWORD_<ROLE>:?message}``, and compose refuses to run
    without them."""
    references = re.findall(r"\$\{(NATS_PASSWORD_[A-Z_]+)(:\?)?", (COMPOSE / "docker-compose.yml").read_text())
    assert {name for name, _ in references} == set(PASSWORD_VARS)
    assert all(required for _, required in references), references
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = run_config(FILE_SETS["cpu"], empty)
    assert proc.returncode != 0 and "NATS_PASSWORD_" in proc.stderr


@pytest.mark.parametrize("missing", PASSWORD_VARS)
def test_each_password_is_required(tmp_path, missing):
    """.env.example less any one password (the monitor's too: ``deepinfer status`` logs in as it): compose
    refuses to run."""
    env = {k: v for k, v in read_env_file(ENV_EXAMPLE).items() if k != missing}
    env_file = tmp_path / "partial.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    proc = run_config(FILE_SETS["cpu"], env_file)
    assert proc.returncode != 0 and missing in proc.stderr, proc.stderr
