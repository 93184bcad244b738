"""``services/router/scaler.KubernetesScaler`` against a stand-in for the Kubernetes API server.

The stand-in replaces only the API call: a real aiohttp server on 127.0.0.1 serving the apps/v1
``deployments/{name}/scale`` subresource (autoscaling/v1 Scale objects) of one namespace. It keeps the replica
count and resourceVersion of each Deployment, and answers as the real API does: 401 for a wrong bearer token,
404 for another path or Deployment, 415 for a PATCH that is not a merge patch, 409 for a stale resourceVersion,
each with a v1 Status body. Invariants checked: a scale changes the stand-in's count by delta within
[min, max]; at a bound nothing is written; every failure is UNAVAILABLE with the API's message, within the
timeout; an unknown role is INVALID_REQUEST; ``in_cluster`` reads the service-account files and verifies TLS
against ``ca.crt``.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from aiohttp import web

from services.router.scaler import MERGE_PATCH, KubernetesScaler, make_scaler
from shared.errors import DeepinferError, ErrorCode
from shared.nats_server import free_port

TOKEN = "sa-token-1"
NS = "deepinfer"


def status(code: int, reason: str, message: str) -> web.Response:
    """A v1 Status, as the API server answers every failure."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


class FakeApiServer:
    """The scale subresource of ``replicas``' Deployments in namespace ``NS`` (see the module docstring)."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas, self.versions = dict(replicas), {name: 1 for name in replicas}
        self.calls: list[tuple[str, str]] = []  # (method, deployment) of every authorised call
        self.patches: list[dict] = []
        self.hang = False
        self.concurrent_scale = False  # someone else scales between our GET and PATCH (once)
        self.release = asyncio.Event()  # set at stop: a hanging handler returns
        self.runner: web.AppRunner | None = None
        self.port = free_port()

    def scale_object(self, name: str) -> dict:
        spec = {"replicas": self.replicas[name]} if self.replicas[name] else {}  # omitempty, as the real API
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": NS, "resourceVersion": str(self.versions[name])},
                "spec": spec, "status": {"replicas": self.replicas[name], "selector": f"component={name}"}}

    async def handle(self, request: web.Request) -> web.Response:
        if self.hang:
            await self.release.wait()
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return status(401, "Unauthorized", "Unauthorized")
        ns, name = request.match_info["ns"], request.match_info["name"]
        if ns != NS or name not in self.replicas:
            return status(404, "NotFound", f'deployments.apps "{name}" not found')
        self.calls.append((request.method, name))
        if request.method == "GET":
            return web.json_response(self.scale_object(name))
        if request.content_type != MERGE_PATCH:
            return status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                       f"accepted media types include: {MERGE_PATCH}")
        if self.concurrent_scale:
            self.concurrent_scale, self.versions[name] = False, self.versions[name] + 1
        patch = json.loads(await request.text())
        self.patches.append(patch)
        version = patch.get("metadata", {}).get("resourceVersion")
        if version is not None and version != str(self.versions[name]):
            return status(409, "Conflict", f'Operation cannot be fulfilled on deployments.apps "{name}": the '
                                           f"object has been modified; please apply your changes to the latest "
                                           f"version and try again")
        self.replicas[name] = patch["spec"]["replicas"]
        self.versions[name] += 1
        return web.json_response(self.scale_object(name))

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> str:
        app = web.Application()
        route = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        app.router.add_get(route, self.handle)
        app.router.add_patch(route, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=ssl_context).start()
        return f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()


def scaler_for(url: str, token: str = TOKEN, timeout_s: float = 5.0, **kw) -> KubernetesScaler:
    return KubernetesScaler(url, NS, {"prefill": "prefill", "decode": "decode"}, token, None, timeout_s,
                            kw.pop("min_replicas", {"prefill": 1, "decode": 1}),
                            kw.pop("max_replicas", {"prefill": 3, "decode": 4}), **kw)


@pytest.fixture()
async def api():
    server = FakeApiServer({"prefill": 1, "decode": 2})
    server.url = await server.start()
    yield server
    await server.stop()


async def test_scale_up_and_down_changes_the_deployments_replicas(api):
    scaler = scaler_for(api.url)
    try:
        assert await scaler.scale("decode", 1) == 3
        assert await scaler.scale("prefill", 1) == 2
        assert await scaler.scale("decode", -1) == 2
    finally:
        await scaler.close()
        await scaler.close()  # twice is fine
    assert api.replicas == {"prefill": 2, "decode": 2}
    assert api.calls == [("GET", "decode"), ("PATCH", "decode"), ("GET", "prefill"), ("PATCH", "prefill"),
                         ("GET", "decode"), ("PATCH", "decode")]
    assert api.patches[0] == {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 3}}


async def test_the_count_is_clamped_and_nothing_is_written_at_a_bound(api):
    scaler = scaler_for(api.url, max_replicas={"prefill": 2, "decode": 4})
    try:
        assert await scaler.scale("prefill", -1) == 1       # at min 1: GET only
        assert await scaler.scale("prefill", 5) == 2        # clamped to max 2
        assert await scaler.scale("prefill", 1) == 2        # at max: GET only
        api.replicas["decode"] = 6  # above max 4, set by hand: a +1 does not shrink it, a -1 does by one
        assert await scaler.scale("decode", 1) == 6
        assert await scaler.scale("decode", -1) == 5
    finally:
        await scaler.close()
    assert api.replicas == {"prefill": 2, "decode": 5}
    assert api.calls == [("GET", "prefill"), ("GET", "prefill"), ("PATCH", "prefill"), ("GET", "prefill"),
                         ("GET", "decode"), ("GET", "decode"), ("PATCH", "decode")]


async def test_zero_replicas_read_as_zero_and_scale_up(api):
    api.replicas["decode"] = 0  # spec.replicas is omitted from the Scale
    scaler = scaler_for(api.url, min_replicas={})
    try:
        assert await scaler.scale("decode", 1) == 1
    finally:
        await scaler.close()
    assert api.replicas["decode"] == 1


async def test_a_wrong_token_is_unavailable_with_the_apis_answer(api):
    scaler = scaler_for(api.url, token="stale")
    try:
        with pytest.raises(DeepinferError) as err:
            await scaler.scale("decode", 1)
    finally:
        await scaler.close()
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert "401 Unauthorized to GET deployment deepinfer/decode (the token is wrong or expired)" in err.value.message
    assert api.replicas["decode"] == 2 and api.calls == []


async def test_a_missing_deployment_and_a_conflict_are_unavailable(api):
    scaler = KubernetesScaler(api.url, NS, {"prefill": "prefill", "decode": "decoder"}, TOKEN)
    try:
        with pytest.raises(DeepinferError) as err:
            await scaler.scale("decode", 1)
        assert err.value.code is ErrorCode.UNAVAILABLE and 'deployments.apps "decoder" not found' in str(err.value)
        api.concurrent_scale = True
        with pytest.raises(DeepinferError) as err:
            await scaler.scale("prefill", 1)
        assert err.value.code is ErrorCode.UNAVAILABLE and "409 Conflict" in err.value.message
    finally:
        await scaler.close()
    assert api.replicas["prefill"] == 1


async def test_an_unknown_role_is_an_invalid_request(api):
    scaler = scaler_for(api.url)
    try:
        for role, delta, message in (("draft", 1, "no Deployment to scale for role 'draft'"),
                                     ("decode", 1.5, "scale delta must be an int")):
            with pytest.raises(DeepinferError) as err:
                await scaler.scale(role, delta)
            assert err.value.code is ErrorCode.INVALID_REQUEST and message in err.value.message
    finally:
        await scaler.close()
    assert api.calls == []


async def test_a_hanging_api_is_unavailable_within_the_timeout(api):
    api.hang = True
    scaler = scaler_for(api.url, timeout_s=0.3)
    start = time.monotonic()
    try:
        with pytest.raises(DeepinferError) as err:
            await scaler.scale("decode", 1)
    finally:
        await scaler.close()
    assert time.monotonic() - start < 1.5
    assert err.value.code is ErrorCode.UNAVAILABLE and "did not answer within 0.3 s" in err.value.message


async def test_an_unreachable_api_is_unavailable():
    scaler = scaler_for(f"http://127.0.0.1:{free_port()}", timeout_s=2.0)  # nothing listens
    try:
        with pytest.raises(DeepinferError) as err:
            await scaler.scale("prefill", 1)
    finally:
        await scaler.close()
    assert err.value.code is ErrorCode.UNAVAILABLE and "unreachable" in err.value.message


@pytest.mark.parametrize("kwargs, message", [
    ({"api_url": "127.0.0.1:6443"}, "must be http(s)://"),
    ({"namespace": "Deep/infer"}, "is not a Kubernetes name"),
    ({"deployments": {}}, "no Deployment to scale"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"min_replicas": {"decode": 3}, "max_replicas": {"decode": 2}}, "are not integers 0 <= min <= max"),
    ({"max_replicas": {"draft": 2}}, "roles ['draft'] without a Deployment"),
])
def test_bad_settings_are_refused(kwargs, message):
    args = {"api_url": "https://10.0.0.1:443", "namespace": NS, "deployments": {"decode": "decode"},
            "token": TOKEN, **kwargs}
    with pytest.raises(DeepinferError, match="invalid_request") as err:
        KubernetesScaler(**args)
    assert message in err.value.message


def service_account(tmp_path: Path, ca: Path | None = None) -> Path:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(TOKEN + "\n")
    (sa / "namespace").write_text(NS)
    if ca is not None:
        shutil.copy(ca, sa / "ca.crt")
    return sa


def self_signed(tmp_path: Path, name: str = "server") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=30)
    return cert, key


async def test_in_cluster_reads_the_service_account_and_verifies_tls(tmp_path):
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = FakeApiServer({"prefill": 1, "decode": 1})
    await server.start(context)
    sa = service_account(tmp_path, ca=cert)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port)}
    scaler = KubernetesScaler.in_cluster(sa_dir=sa, env=env, max_replicas={"decode": 2})
    try:
        assert (scaler.api_url, scaler.namespace, scaler.deployments) == \
            (f"https://127.0.0.1:{server.port}", NS, {"prefill": "prefill", "decode": "decode"})
        assert await scaler.scale("decode", 1) == 2
        (sa / "token").write_text("rotated")  # the kubelet rotated the token: the next call sends the new one
        with pytest.raises(DeepinferError, match="401 Unauthorized"):
            await scaler.scale("decode", -1)
    finally:
        await scaler.close()
        await server.stop()
    assert server.replicas["decode"] == 2


async def test_tls_against_another_ca_is_unavailable(tmp_path):
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = FakeApiServer({"decode": 1})
    await server.start(context)
    other, _ = self_signed(tmp_path, "other")  # same subject, another key: not the server's CA
    scaler = KubernetesScaler(f"https://127.0.0.1:{server.port}", NS, {"decode": "decode"}, TOKEN, str(other))
    try:
        with pytest.raises(DeepinferError) as err:
            await scaler.scale("decode", 1)
    finally:
        await scaler.close()
        await server.stop()
    assert err.value.code is ErrorCode.UNAVAILABLE and "certificate verify failed" in err.value.message
    assert server.calls == []


def test_in_cluster_outside_a_pod_is_unavailable(tmp_path):
    with pytest.raises(DeepinferError, match="KUBERNETES_SERVICE_HOST") as err:
        KubernetesScaler.in_cluster(sa_dir=tmp_path, env={})
    assert err.value.code is ErrorCode.UNAVAILABLE
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(DeepinferError, match="no service account mounted") as err:
        KubernetesScaler.in_cluster(sa_dir=tmp_path / "missing", env=env)
    scaler = KubernetesScaler.in_cluster("other-ns", {"decode": "dec"}, sa_dir=service_account(tmp_path), env=env)
    assert (scaler.api_url, scaler.namespace, scaler.deployments) == ("https://10.96.0.1:443", "other-ns",
                                                                      {"decode": "dec"})


def test_make_scaler_names_the_kinds():
    assert make_scaler("none") is None
    with pytest.raises(DeepinferError, match="no scaler of kind 'swarm'"):
        make_scaler("swarm")
