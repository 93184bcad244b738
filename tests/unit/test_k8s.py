"""compose/k8s/: the Kubernetes manifests are valid, and every deepinfer container starts from a config it accepts.

No cluster needed: compose/k8s/manifests.py builds the objects as ``kubectl kustomize`` would (the CPU deployment
compose/k8s and the GPU one compose/k8s/gpu), the Secret holding what ``python -m shared.nats_auth env --monitor
--cluster`` prints. Invariants:
- every object passes kubernetes-validate in strict mode (no unknown field) against Kubernetes ``K8S_VERSION``;
- ``manifests.problems`` finds nothing: probes, ports, resources, budgets, grace periods, and each container's
  env and args through its config class (as test_compose.py does for compose);
- the NATS cluster has three nodes routed through the headless Service, names itself after its pods, keeps
  JetStream on its PVCs, has the users and permissions of compose/nats.conf (auth.conf equals the generator's
  authorization block), and nats-server accepts the config its init container renders;
- prefill, decode and draft scale on their own (Deployments, no fixed worker id), the cache tier keeps its
  id and its SSD files on a PVC; the GPU variant gives each engine pod a GPU and the CUDA image.
- the router's ServiceAccount may only get/patch the scale of the prefill and decode Deployments.
The negative tests break a copy of the built objects and assert that the checks reject it.
"""
from __future__ import annotations

import copy
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shared.nats_auth import render_compose_config
from shared.nats_server import find_nats_server

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "compose" / "k8s"
K8S_VERSION = "1.34.0"  # the Kubernetes API the manifests are validated against
VARIANTS = {"cpu": K8S, "cuda": K8S / "gpu"}  # ("gpu" would be a pytest keyword: conftest skips those on CPU)
ENGINES = ("prefill", "decode", "draft")  # Deployments that scale on their own


def _load_manifests():
    """compose/k8s/manifests.py by path (compose/ is no package; a `compose` module may be installed)."""
    spec = importlib.util.spec_from_file_location("deepinfer_k8s_manifests", K8S / "manifests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


m = _load_manifests()


@pytest.fixture(scope="module")
def passwords() -> dict[str, str]:
    """What the README's command writes to nats-passwords.env: NATS_PASSWORD_<USER>=..., the route's too."""
    out = subprocess.run([sys.executable, "-m", "shared.nats_auth", "env", "--monitor", "--cluster"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def objects(request, passwords) -> list[dict]:
    return m.build(VARIANTS[request.param], passwords)


@pytest.fixture()
def base(passwords) -> list[dict]:
    return m.build(K8S, passwords)


def container(objects: list[dict], kind: str, name: str) -> dict:
    return m.containers(m.find(objects, kind, name))[0]


def config(objects: list[dict], kind: str, name: str):
    workload = m.find(objects, kind, name)
    return m.load(objects, workload, m.containers(workload)[0])


def test_every_object_validates_strictly(objects):
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap", "Secret"} <= kinds
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_no_problems(objects, passwords):
    assert m.problems(objects, passwords) == []


def test_every_manifest_is_deployed_and_the_passwords_stay_out_of_git():
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in (K8S / "base").glob("*.yaml")
                                               if p.name != "kustomization.yaml")
    assert base["secretGenerator"] == [{"name": "nats-passwords", "envs": [m.PASSWORD_FILE]}]
    assert m.PASSWORD_FILE in (K8S / ".gitignore").read_text().split()
    assert yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"] == ["base"]
    assert yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())["resources"] == ["../base"]


def test_engines_scale_on_their_own_and_reach_the_cache_tier_and_draft_service(base):
    for name in ENGINES:
        env = {v["name"] for v in container(base, "Deployment", name).get("env", [])}
        assert "DEEPINFER_WORKER_ID" not in env, f"{name}: a fixed id breaks kubectl scale"
        assert config(base, "Deployment", name).worker_id.startswith(f"{name}-"), name
    tier_set = m.find(base, "StatefulSet", "cache-tier")
    tier = config(base, "StatefulSet", "cache-tier")
    assert tier_set["spec"]["replicas"] == 1 and tier.worker_id == "cache-tier-0"  # its pod name
    assert {config(base, "Deployment", n).cache_tier for n in ("prefill", "decode")} == {tier.worker_id}
    assert config(base, "Deployment", "decode").draft == "remote"
    models = {n: config(base, "Deployment", n).model for n in ("router", *ENGINES)}
    assert len(set(models.values())) == 1, f"router, workers and draft must serve one model: {models}"
    mounts = {v["mountPath"]: v["name"] for v in container(base, "StatefulSet", "cache-tier")["volumeMounts"]}
    (claim,) = [c for c in tier_set["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == mounts[tier.directory]]
    assert tier.ssd_mb * 2**20 < m.quantity(claim["spec"]["resources"]["requests"]["storage"])


def test_router_is_ready_on_health_behind_its_service(base):
    router = container(base, "Deployment", "router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    service = m.find(base, "Service", "router")["spec"]["ports"]
    assert [m.port_of(router, p["targetPort"]) for p in service] == [config(base, "Deployment", "router").http_port]


def test_router_may_scale_prefill_and_decode_only(objects):
    """The planner's KubernetesScaler (services/router/scaler.py): the router's pods run as ServiceAccount
    router, whose only grant is get/patch on the scale subresource of the prefill and decode Deployments."""
    pod = m.find(objects, "Deployment", "router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "router" and pod["automountServiceAccountToken"] is True
    assert m.find(objects, "ServiceAccount", "router")["automountServiceAccountToken"] is False  # others: no token
    role = m.find(objects, "Role", "router-scaler")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": ["prefill", "decode"], "verbs": ["get", "patch"]}]
    binding = m.find(objects, "RoleBinding", "router-scaler")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "router-scaler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "router", "namespace": "deepinfer"}]
    assert {role["metadata"]["namespace"], binding["metadata"]["namespace"]} == {"deepinfer"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] in ("Role", "RoleBinding", "ClusterRole",
                                                                   "ClusterRoleBinding")] == ["router-scaler"] * 2
    for name in ("prefill", "decode"):
        assert m.find(objects, "Deployment", name)["metadata"]["namespace"] == "deepinfer"
        assert "serviceAccountName" not in m.find(objects, "Deployment", name)["spec"]["template"]["spec"]


def test_threads_follow_the_cpu_limit(base):
    """A CPU quota does not shrink the CPUs Python sees: threads must be set to the limit (see compose/README)."""
    for name in ENGINES:
        limit = m.quantity(container(base, "Deployment", name)["resources"]["limits"]["cpu"])
        assert config(base, "Deployment", name).threads == limit, name


def test_gpu_variant_gives_each_engine_a_gpu_and_the_cuda_image(passwords, base):
    gpu = m.build(VARIANTS["cuda"], passwords)
    for name in ENGINES:
        assert container(gpu, "Deployment", name)["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert "nvidia.com/gpu" not in container(base, "Deployment", name)["resources"]["limits"], name
    assert config(gpu, "Deployment", "decode").device == "cuda"
    for kind, name in (("Deployment", "router"), ("StatefulSet", "cache-tier")):
        assert "nvidia.com/gpu" not in container(gpu, kind, name)["resources"]["limits"], name
    images = {c["image"] for w in m.workloads(gpu) for c in m.containers(w) if c.get("args", [""])[0] in m.CONFIGS}
    assert images == {"deepinfer:cuda"}


def nats_conf(objects: list[dict]) -> str:
    return m.find(objects, "ConfigMap", "nats-config")["data"]["nats.conf"]


def test_nats_is_a_three_node_cluster_with_jetstream_on_pvcs(base):
    nats = m.find(base, "StatefulSet", "nats")["spec"]
    headless = m.find(base, "Service", nats["serviceName"])["spec"]
    assert nats["replicas"] == 3 and headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"]
    assert {p["port"] for p in headless["ports"]} == {4222, 6222, 8222}
    assert {p["port"] for p in m.find(base, "Service", "nats-client")["spec"]["ports"]} == {4222, 8222}
    conf = nats_conf(base)
    routes = re.findall(r'"nats-route://route:__ROUTE_PASSWORD__@([^"]+)"', conf)
    assert routes == [f"nats-{i}.{nats['serviceName']}:6222" for i in range(nats["replicas"])]
    assert re.search(r"^server_name: \$POD_NAME\b", conf, re.M)
    (pod_name,) = [v for v in container(base, "StatefulSet", "nats")["env"] if v["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    store = re.search(r'store_dir: "([^"]+)"', conf)[1]
    mounts = {v["name"]: v["mountPath"] for v in container(base, "StatefulSet", "nats")["volumeMounts"]}
    assert [store.startswith(mounts[c["metadata"]["name"]] + "/") for c in nats["volumeClaimTemplates"]] == [True]
    grace = nats["template"]["spec"]["terminationGracePeriodSeconds"]
    lame_duck = [int(re.search(rf'{k}: "(\d+)s"', conf)[1]) for k in ("lame_duck_duration", "lame_duck_grace_period")]
    assert grace > sum(lame_duck)


def test_nats_users_and_permissions_are_the_generators(base):
    """auth.conf, less its comments, is the authorization block of compose/nats.conf's generator."""
    data = m.find(base, "ConfigMap", "nats-config")["data"]
    assert "\ninclude ./auth.conf\n" in data["nats.conf"]
    generated = render_compose_config(monitor=True)
    ours = "".join(line for line in data["auth.conf"].splitlines(keepends=True) if not line.startswith("#"))
    assert ours == generated[generated.index("authorization {"):], \
        "compose/k8s/base/nats/auth.conf is stale: rewrite it from `python -m shared.nats_auth compose --monitor`"


def render_nats_config(objects: list[dict], tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the nats init container's script here, its mounts mapped to tmp_path/template (the ConfigMap's files)
    and tmp_path/rendered."""
    (init,) = m.find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["initContainers"]
    mounts = {v["name"]: v["mountPath"] for v in init["volumeMounts"]}
    template, rendered = tmp_path / "template", tmp_path / "rendered"
    template.mkdir(), rendered.mkdir()
    for key, text in m.find(objects, "ConfigMap", "nats-config")["data"].items():
        (template / key).write_text(text)
    script = init["command"][-1].replace(mounts["config-template"], str(template))
    script = script.replace(mounts["config"] + "/", f"{rendered}/")
    return subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                          text=True, timeout=30)


def test_nats_server_accepts_the_rendered_config(base, passwords, tmp_path):
    """The init container renders a config nats-server accepts; the nats container has every password it names."""
    workload = m.find(base, "StatefulSet", "nats")
    (init,) = workload["spec"]["template"]["spec"]["initContainers"]
    proc = render_nats_config(base, tmp_path, m.container_env(base, workload, init))
    assert proc.returncode == 0, proc.stderr
    rendered = tmp_path / "rendered"
    conf = (rendered / "nats.conf").read_text()
    assert "__ROUTE_PASSWORD__" not in conf and conf.count(f"route:{passwords['NATS_PASSWORD_ROUTE']}@") == 3
    nats_env = m.container_env(base, workload, container(base, "StatefulSet", "nats"))
    named = set(re.findall(r"^\s*\w+: \$(\w+)", conf + (rendered / "auth.conf").read_text(), re.M))  # $VAR values
    assert named <= nats_env.keys(), f"the nats container lacks {sorted(named - nats_env.keys())}"
    proc = subprocess.run([find_nats_server(), "-t", "-c", str(rendered / "nats.conf")], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/bin:/bin", **nats_env})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("route_password", ["", "a/b", "x y"])
def test_the_nats_init_container_refuses_a_route_password_it_cannot_render(base, tmp_path, route_password):
    proc = render_nats_config(base, tmp_path, {"NATS_PASSWORD_ROUTE": route_password})
    assert proc.returncode == 1 and "NATS_PASSWORD_ROUTE must be" in proc.stderr
    assert not (tmp_path / "rendered" / "nats.conf").exists()


def test_strict_validation_rejects_an_unknown_field(base):
    broken = copy.deepcopy(m.find(base, "Deployment", "decode"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/metrics"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _decode(objects):
    return container(objects, "Deployment", "decode")


def _set_env(objects, name, value):
    env = _decode(objects)["env"]
    env[:] = [v for v in env if v["name"] != name] + [{"name": name, "value": value}]


# A mutation of the CPU deployment and a piece of the problem ``problems`` must then report.
BREAKAGES = {
    "no readiness probe": (lambda o: _decode(o).pop("readinessProbe"), "decode/decode: no readinessProbe"),
    "probe on an undeclared port": (lambda o: _decode(o)["livenessProbe"]["httpGet"].update(port=9401),
                                    "livenessProbe port 9401 is not a container port"),
    "probe on a path not served": (lambda o: _decode(o)["readinessProbe"]["httpGet"].update(path="/health"),
                                   "readinessProbe GETs /health"),
    "metrics on another port": (lambda o: _set_env(o, "DEEPINFER_METRICS_PORT", "9500"), "GETs /metrics on metrics"),
    "service target port missing": (
        lambda o: m.find(o, "Service", "router")["spec"]["ports"][0].update(targetPort="htp"),
        "Service router: target port htp"),
    "grace below the drain": (
        lambda o: m.find(o, "Deployment", "decode")["spec"]["template"]["spec"].update(
            terminationGracePeriodSeconds=20), "decode: grace 20 s"),
    "budget selects nothing": (
        lambda o: m.find(o, "PodDisruptionBudget", "decode")["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "decoder"}), "PodDisruptionBudget decode selects no pods"),
    "no memory limit": (lambda o: _decode(o)["resources"]["limits"].pop("memory"), "a memory limit"),
    "env var that is no field": (lambda o: _set_env(o, "DEEPINFER_METRICS_PORTS", "9400"),
                                 "['DEEPINFER_METRICS_PORTS'] are not fields of WorkerConfig"),
    "flag that does not parse": (lambda o: _decode(o)["args"].append("--no-such-flag"), "rejects the flags"),
    "invalid config": (lambda o: _set_env(o, "DEEPINFER_KV_CACHE_MB", "0"), "kv_cache_mb"),
    "another role's password": (
        lambda o: _decode(o)["env"][1]["valueFrom"]["secretKeyRef"].update(key="NATS_PASSWORD_PREFILL"),
        "does not log in as NATS user decode"),
    "missing secret key": (
        lambda o: _decode(o)["env"][1]["valueFrom"]["secretKeyRef"].update(key="NATS_PASSWORD_NOBODY"),
        "has no key NATS_PASSWORD_NOBODY"),
    "one NATS node only": (lambda o: _set_env(o, "DEEPINFER_NATS_URL", "nats://nats-0.nats:4222"), "not ['nats://"),
    "registry on one node": (lambda o: _set_env(o, "DEEPINFER_REGISTRY_REPLICAS", "1"), "1 registry replicas"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_problems_rejects_a_broken_deployment(base, passwords, breakage):
    mutate, expected = BREAKAGES[breakage]
    assert _decode(base)["env"][1]["name"] == "DEEPINFER_NATS_PASSWORD"  # what two breakages change
    mutate(base)
    found = m.problems(base, passwords)
    assert any(expected in p for p in found), found
