"""An offline model of the Kubernetes deployment in compose/k8s, for tests/unit/test_k8s.py (no cluster needed).

- ``build(path, passwords)`` does what ``kubectl kustomize path`` does for the features compose/k8s uses:
  resources (files and folders), configMapGenerator (files, literals), secretGenerator (only the NATS
  passwords, whose values the caller passes: nats-passwords.env is never in the repository), images and
  strategic-merge patches whose lists of named items merge by name. Generated names keep no hash suffix.
- ``container_env`` is the environment Kubernetes gives a container (envFrom, then env; Secret and ConfigMap
  keys, the pod name, resource fields); ``load`` runs it with the container's args through the service's config
  class exactly as its ``__main__`` does (env, then flags).
- ``problems(objects, passwords)`` lists every fault a schema cannot see, one line each, and nothing else:
  containers without readiness/liveness probes, requests or a memory limit; probes on undeclared ports or on
  paths/ports the service does not serve (the aiohttp routes in the code); configs that do not load, log in as
  another NATS user, miss a NATS node or the registry's replicas; grace periods shorter than preStop +
  ``drain_grace_s`` + ``SHUTDOWN_MARGIN_S``; Services and budgets that select no pods or name missing ports;
  workloads without a PodDisruptionBudget.
Nothing here prints, writes files or contacts a cluster; ``load`` swaps the process's DEEPINFER_* variables
for the container's while it runs (restored after).
"""
from __future__ import annotations

import base64
import copy
import dataclasses
import math
import os
import re
from pathlib import Path
from unittest import mock

import yaml

from services.cache_tier.config import CacheTierConfig

from services.draft.config import DraftConfig

from services.router.config import RouterConfig

from services.worker.config import WorkerConfig

from shared.config import load_config
from shared.nats_auth import password_env

ROOT = Path(__file__).resolve().parents[2]
PASSWORD_FILE = "nats-passwords.env"  # git-ignored; the Secret nats-passwords is generated from it
SHUTDOWN_MARGIN_S = 10.0  # after drain_grace_s: hand-back (shared.bus.HAND_BACK_WAIT_S), closing, NATS drain
# The module a container runs -> its config class, what its __main__ fixes, its NATS user.
CONFIGS = {
    "services.router": (RouterConfig, {}, "router"),
    "services.prefill": (WorkerConfig, {"role": "prefill"}, "prefill"),
    "services.decode": (WorkerConfig, {"role": "decode"}, "decode"),
    "services.cache_tier": (CacheTierConfig, {}, "cache-tier"),
    "services.draft": (DraftConfig, {}, "draft"),
}
UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def served_paths(path: Path) -> set[str]:
    """The paths an aiohttp module serves with GET (its ``add_get("/path", ...)`` calls)."""
    return set(re.findall(r'add_get\("([^"]+)"', path.read_text()))


ROUTER_PATHS = served_paths(ROOT / "services" / "router" / "http_api.py")  # /health, /metrics, /v1/models
METRICS_PATHS = served_paths(ROOT / "shared" / "metrics" / "server.py")  # workers, cache tier, draft: /metrics


def quantity(text) -> float:
    """A Kubernetes quantity as a number: "500m" -> 0.5, "2" -> 2, "20Gi" -> 20 * 2**30."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * UNITS[unit]


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} {kind} objects named {name!r}")
    return found[0]


def merge(base: dict, patch: dict) -> None:
    """Strategic merge as compose/k8s/gpu uses it: maps merge, lists of named items (containers, env) merge by
    name (the patch's items first, in its order, then the base's others, as kustomize orders them), anything
    else is replaced."""
    for key, value in patch.items():
        old = base.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) \
                and all(isinstance(v, dict) and "name" in v for v in [*value, *old]):
            named = {v["name"]: v for v in old}
            for item in value:
                merge(named.setdefault(item["name"], {}), item)
            patched = [named[item["name"]] for item in value]
            old[:] = patched + [v for v in old if v["name"] not in {p["name"] for p in patched}]
        else:
            base[key] = copy.deepcopy(value)


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(workload: dict, init: bool = False) -> list[dict]:
    """The pod template's containers (its init containers first when ``init``)."""
    spec = workload["spec"]["template"]["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def build(path: Path, passwords: dict[str, str]) -> list[dict]:
    """The objects ``kubectl kustomize path`` prints (see the module docstring), the Secret generated from
    ``passwords`` (``NATS_PASSWORD_<USER>`` -> password)."""
    spec = yaml.safe_load((path / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for res in spec.get("resources", []):
        target = path / res
        objects += build(target, passwords) if target.is_dir() else list(yaml.safe_load_all(target.read_text()))
    for gen in spec.get("configMapGenerator", []):
        data = {Path(f).name: (path / f).read_text() for f in gen.get("files", [])}
        data.update(line.split("=", 1) for line in gen.get("literals", []))
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for gen in spec.get("secretGenerator", []):
        if gen.get("envs") != [PASSWORD_FILE]:
            raise ValueError(f"secretGenerator {gen['name']}: only the NATS passwords ({PASSWORD_FILE}) are known")
        data = {k: base64.b64encode(v.encode()).decode() for k, v in passwords.items()}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]}, "type": "Opaque",
                        "data": data})
    for patch in spec.get("patches", []):
        for doc in yaml.safe_load_all((path / patch["path"]).read_text()):
            merge(find(objects, doc["kind"], doc["metadata"]["name"]), doc)
    for image in spec.get("images", []):
        for c in [c for w in workloads(objects) for c in containers(w, init=True)]:
            if c["image"].rsplit(":", 1)[0] == image["name"]:
                c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for o in objects:
        if "namespace" in spec and o["kind"] != "Namespace":
            o["metadata"]["namespace"] = spec["namespace"]
    return objects


def selects(selector: dict, workload: dict) -> bool:
    """Whether ``selector`` (a Service's label map or a ``matchLabels`` selector) picks ``workload``'s pods."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    wanted = selector.get("matchLabels", selector)  # a Service's selector is the label map itself
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def port_of(container: dict, port) -> int | None:
    """The container port a probe or Service names (by name or number); None when the container has none such."""
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def pod_name(workload: dict) -> str:
    """A name the workload's first pod has: ordinal 0 for a StatefulSet, a generated one for a Deployment."""
    name = workload["metadata"]["name"]
    return f"{name}-0" if workload["kind"] == "StatefulSet" else f"{name}-7d9c5b6f4-x2x7q"


def data_of(objects: list[dict], kind: str, name: str, optional: bool = False) -> dict[str, str]:
    """A ConfigMap's or Secret's data, decoded; {} for a missing optional one (LookupError otherwise)."""
    try:
        obj = find(objects, kind, name)
    except LookupError:
        if optional:
            return {}
        raise
    if kind == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
    return dict(obj.get("data", {}))


def container_env(objects: list[dict], workload: dict, c: dict) -> dict[str, str]:
    """The environment Kubernetes gives container ``c``: envFrom, then env (a later name wins)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
        env.update(data_of(objects, kind, ref["name"], ref.get("optional", False)))
    for var in c.get("env", []):
        source = var.get("valueFrom", {})
        if not source:
            env[var["name"]] = var.get("value", "")
        elif "fieldRef" in source:
            if source["fieldRef"]["fieldPath"] != "metadata.name":
                raise ValueError(f"{var['name']}: only the pod name is modelled, not {source['fieldRef']}")
            env[var["name"]] = pod_name(workload)
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, resource = ref["resource"].split(".")
            amount = quantity(c["resources"][kind][resource]) / quantity(ref.get("divisor", 1))
            env[var["name"]] = str(math.ceil(amount))  # rounded up, as the kubelet does
        else:
            kind, ref = ("ConfigMap", source["configMapKeyRef"]) if "configMapKeyRef" in source \
                else ("Secret", source["secretKeyRef"])
            data = data_of(objects, kind, ref["name"], ref.get("optional", False))
            if ref["key"] in data:
                env[var["name"]] = data[ref["key"]]
            elif not ref.get("optional"):
                raise LookupError(f"{kind} {ref['name']} has no key {ref['key']}")
    return env


def load(objects: list[dict], workload: dict, c: dict):
    """The config ``python -m <args>`` builds in container ``c`` (env then flags, as its __main__ does). ValueError
    when a DEEPINFER_* variable is no field, a flag does not parse or the config does not validate. While it runs,
    ``os.environ`` holds exactly the container's DEEPINFER_* variables (restored after; not thread-safe)."""
    module, *argv = c["args"]
    cls, fixed, _ = CONFIGS[module]
    env = {k: v for k, v in container_env(objects, workload, c).items() if k.startswith("DEEPINFER_")}
    unknown = env.keys() - {f"DEEPINFER_{f.name.upper()}" for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not fields of {cls.__name__}")
    outside = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    with mock.patch.dict(os.environ, {**outside, **env}, clear=True):
        try:
            return load_config(cls, argv, **fixed)
        except SystemExit:
            raise ValueError(f"{cls.__name__}'s parser rejects the flags {argv}") from None


def prestop_s(c: dict) -> float:
    """Seconds container ``c``'s preStop hook sleeps (``exec: sleep N`` or ``sleep: {seconds: N}``), else 0."""
    hook = c.get("lifecycle", {}).get("preStop", {})
    command = hook.get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else float(hook.get("sleep", {}).get("seconds", 0))


def config_problems(objects: list[dict], w: dict, c: dict, passwords: dict[str, str]) -> list[str]:
    """The faults of deepinfer container ``c`` of workload ``w`` that its config reveals."""
    name, module = w["metadata"]["name"], c["args"][0]
    try:
        cfg = load(objects, w, c)
    except (ValueError, TypeError, LookupError) as err:
        return [f"{name}: {err}"]
    out = []
    user = CONFIGS[module][2]
    if cfg.nats_user != user or cfg.nats_password != passwords[password_env(user)]:
        out.append(f"{name}: does not log in as NATS user {user} with its password")
    nats = find(objects, "StatefulSet", "nats")["spec"]
    nodes = [f"nats://nats-{i}.{nats['serviceName']}:4222" for i in range(nats["replicas"])]
    if cfg.nats_url != ",".join(nodes) or cfg.registry_replicas != nats["replicas"]:
        out.append(f"{name}: NATS {cfg.nats_url} with {cfg.registry_replicas} registry replicas, not {nodes}")
    grace = w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    if grace < prestop_s(c) + cfg.drain_grace_s + SHUTDOWN_MARGIN_S:
        out.append(f"{name}: grace {grace} s < preStop {prestop_s(c)} s + drain {cfg.drain_grace_s} s + margin")
    router = module == "services.router"
    port, paths = (cfg.http_port, ROUTER_PATHS) if router else (cfg.metrics_port, METRICS_PATHS)
    if router and cfg.http_host != "0.0.0.0":
        out.append(f"{name}: HTTP on {cfg.http_host}, unreachable from outside the pod")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c.get(kind, {}).get("httpGet")
        if get and (port_of(c, get["port"]) != port or get["path"].split("?")[0] not in paths):
            out.append(f"{name}: {kind} GETs {get['path']} on {get['port']}; it serves {sorted(paths)} on {port}")
    return out


def problems(objects: list[dict], passwords: dict[str, str]) -> list[str]:
    """Every fault of ``objects`` that a schema cannot see (the module docstring lists them)."""
    out = []
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for w in workloads(objects):
        name = w["metadata"]["name"]
        if not selects(w["spec"]["selector"], w):
            out.append(f"{name}: its selector does not match its pod template")
        if not any(selects(p["spec"]["selector"], w) for p in pdbs):
            out.append(f"{name}: no PodDisruptionBudget")
        for c in containers(w, init=True):
            res = c.get("resources", {})
            if not {"cpu", "memory"} <= res.get("requests", {}).keys() or "memory" not in res.get("limits", {}):
                out.append(f"{name}/{c['name']}: needs CPU and memory requests and a memory limit")
        for c in containers(w):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    out += [] if kind == "startupProbe" else [f"{name}/{c['name']}: no {kind}"]
                    continue
                action = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc")
                if action and port_of(c, action["port"]) is None:
                    out.append(f"{name}/{c['name']}: {kind} port {action['port']} is not a container port")
            if c.get("args", [""])[0] in CONFIGS:
                out += config_problems(objects, w, c, passwords)
    for svc in (o for o in objects if o["kind"] == "Service"):
        pods = [w for w in workloads(objects) if selects(svc["spec"]["selector"], w)]
        if not pods:
            out.append(f"Service {svc['metadata']['name']} selects no pods")
        for p in svc["spec"]["ports"]:
            if any(all(port_of(c, p.get("targetPort", p["port"])) is None for c in containers(w)) for w in pods):
                out.append(f"Service {svc['metadata']['name']}: target port {p.get('targetPort')} not in its pods")
    for pdb in pdbs:
        if not any(selects(pdb["spec"]["selector"], w) for w in workloads(objects)):
            out.append(f"PodDisruptionBudget {pdb['metadata']['name']} selects no pods")
    return out
