"""Deployment scaling for the online P:D planner (``services/router/policy/pd_planner.py``): where workers cannot switch
role, a ``scale`` decision asks the deployment for one prefill or decode worker more or less.

``Scaler`` is the interface the router's planner calls; ``KubernetesScaler`` implements it with the ``scale``
subresource of each role's Deployment (``apps/v1``, an ``autoscaling/v1`` Scale object):

- GET ``/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` reads the desired count ``spec.replicas``
  (absent means 0: the field is ``omitempty``);
- the new count is ``current + delta`` clamped to ``[min_replicas[role], max_replicas[role]]``, moving only in
  the direction of ``delta`` (a count someone set outside the bounds is left alone); unchanged: nothing written;
- PATCH of the same path with ``{"metadata": {"resourceVersion": rv}, "spec": {"replicas": n}}`` as
  ``application/merge-patch+json``: the resourceVersion makes the API server refuse (409) a write over a change
  made since the GET, so a concurrent ``kubectl scale`` is never silently overwritten.

Invariants: one ``scale`` call at a time per scaler (a lock: read-modify-write); a call, both requests included,
ends within ``timeout_s``; every failure of the API (refused, missing, unreachable, slow, malformed) is a
``DeepinferError`` with code ``UNAVAILABLE`` and the API's own message; an unknown role is ``INVALID_REQUEST``.
The token is sent as ``Authorization: Bearer``; with ``token_file`` it is re-read on every call (the kubelet
rotates projected service-account tokens). With ``ca_file`` the server certificate is verified against it.
"""
from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from shared.errors import DeepinferError, ErrorCode, invalid

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # token, ca.crt, namespace
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_DEPLOYMENTS = {"prefill": "prefill", "decode": "decode"}  # compose/k8s/base: role -> Deployment
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # namespace and Deployment names (RFC 1123)


class Scaler(abc.ABC):
    """Changes how many workers a role ("prefill" or "decode") has, through whatever runs them."""

    @abc.abstractmethod
    async def scale(self, role: str, delta: int) -> int:
        """Ask for ``delta`` workers more (or fewer) of ``role``; the new desired count (clamped to the
        scaler's bounds). Raises ``DeepinferError``: ``INVALID_REQUEST`` for an unknown role, ``UNAVAILABLE``
        when the platform cannot be asked or refuses."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; safe to call twice."""


def _unavailable(message: str) -> DeepinferError:
    return DeepinferError(ErrorCode.UNAVAILABLE, message)


class KubernetesScaler(Scaler):
    """The scale subresource of one Deployment per role (see the module docstring)."""

    def __init__(self, api_url: str, namespace: str, deployments: Mapping[str, str], token: str,
                 ca_file: str | None = None, timeout_s: float = 5.0, min_replicas: Mapping[str, int] | None = None,
                 max_replicas: Mapping[str, int] | None = None, *, token_file: str | Path | None = None) -> None:
        if not api_url.startswith(("https://", "http://")):
            raise invalid(f"Kubernetes API URL must be http(s)://host:port, not {api_url!r}")
        if not deployments:
            raise invalid("no Deployment to scale: give at least one role -> Deployment")
        for what, name in [("namespace", namespace), *(("deployment", d) for d in deployments.values())]:
            if not isinstance(name, str) or not _DNS_LABEL.fullmatch(name):
                raise invalid(f"{what} {name!r} is not a Kubernetes name (lowercase RFC 1123 label)")
        if not timeout_s > 0:
            raise invalid(f"timeout_s must be > 0, not {timeout_s}")
        if not token and token_file is None:
            raise invalid("no service-account token: the Kubernetes API would refuse every call")
        self.min_replicas, self.max_replicas = dict(min_replicas or {}), dict(max_replicas or {})
        stray = {*self.min_replicas, *self.max_replicas} - deployments.keys()
        if stray:
            raise invalid(f"replica bounds for roles {sorted(stray)} without a Deployment ({sorted(deployments)})")
        for role in deployments:
            low, high = self.min_replicas.get(role, 0), self.max_replicas.get(role)
            if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
                raise invalid(f"role {role}: replica bounds [{low}, {high}] are not integers 0 <= min <= max")
        self.api_url = api_url.rstrip("/")
        self.namespace, self.deployments = namespace, dict(deployments)
        self.timeout_s = float(timeout_s)
        self._token, self._token_file = token, Path(token_file) if token_file is not None else None
        self._ssl: ssl.SSLContext | bool = True  # system CAs for https without a CA file
        if ca_file is not None:
            try:
                self._ssl = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as err:
                raise invalid(f"cannot load the Kubernetes CA file {ca_file}: {err}") from err
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def in_cluster(cls, namespace: str | None = None, deployments: Mapping[str, str] | None = None,
                   timeout_s: float = 5.0, min_replicas: Mapping[str, int] | None = None,
                   max_replicas: Mapping[str, int] | None = None, *, sa_dir: str | Path = SERVICE_ACCOUNT_DIR,
                   env: Mapping[str, str] | None = None) -> KubernetesScaler:
        """The scaler a pod builds from its service account: the API at ``KUBERNETES_SERVICE_HOST`` and
        ``KUBERNETES_SERVICE_PORT``, the token (re-read on every call), ``ca.crt`` and, unless ``namespace`` is
        given, the pod's own namespace from ``sa_dir``. ``UNAVAILABLE`` outside a pod (no such variables or
        files; ``automountServiceAccountToken: false`` leaves the files out)."""
        env = os.environ if env is None else env
        sa_dir = Path(sa_dir)
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise _unavailable("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT unset")
        host = f"[{host}]" if ":" in host else host  # an IPv6 cluster IP
        try:
            token = (sa_dir / "token").read_text().strip()
            if namespace is None:
                namespace = (sa_dir / "namespace").read_text().strip()
        except OSError as err:
            raise _unavailable(f"no service account mounted at {sa_dir} (is automountServiceAccountToken "
                               f"false?): {err}") from err
        ca_file = sa_dir / "ca.crt"
        return cls(f"https://{host}:{port}", namespace, deployments or DEFAULT_DEPLOYMENTS, token,
                   str(ca_file) if ca_file.exists() else None, timeout_s, min_replicas, max_replicas,
                   token_file=sa_dir / "token")

    async def scale(self, role: str, delta: int) -> int:
        name = self.deployments.get(role)
        if name is None:
            raise invalid(f"no Deployment to scale for role {role!r}; known roles: {sorted(self.deployments)}")
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise invalid(f"scale delta must be an int, not {delta!r}")
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/scale"
        where = f"deployment {self.namespace}/{name}"
        try:
            async with asyncio.timeout(self.timeout_s), self._lock:  # the wait for the lock counts too
                current, version = self._parse(await self._call("GET", path, None, where), where)
                low, high = self.min_replicas.get(role, 0), self.max_replicas.get(role)
                if delta > 0:  # never past max; a count already above it stays (a +1 never shrinks)
                    wanted = max(current, current + delta if high is None else min(high, current + delta))
                else:  # never below min; a count already under it stays
                    wanted = min(current, max(low, current + delta))
                if wanted == current:  # at a bound already: nothing to write
                    log.info("scale %s %+d: %s stays at %d replicas (bounds [%d, %s])",
                             role, delta, where, current, low, high)
                    return current
                patch = {"spec": {"replicas": wanted}}
                if version:
                    patch["metadata"] = {"resourceVersion": version}
                new, _ = self._parse(await self._call("PATCH", path, patch, where), where)
        except TimeoutError:
            raise _unavailable(f"Kubernetes API did not answer within {self.timeout_s} s scaling {where}") \
                from None
        except aiohttp.ClientError as err:
            raise _unavailable(f"Kubernetes API unreachable scaling {where}: {err}") from err
        log.info("scale %s %+d: %s %d -> %d replicas", role, delta, where, current, new)
        return new

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _token_now(self) -> str:
        if self._token_file is None:
            return self._token
        try:
            return self._token_file.read_text().strip()
        except OSError as err:
            raise _unavailable(f"cannot read the service-account token {self._token_file}: {err}") from err

    async def _call(self, method: str, path: str, body: dict | None, where: str) -> dict:
        """One API request; the decoded JSON object of a 2xx answer, else ``UNAVAILABLE`` with the API's
        Status message (401 bad token, 403 no RBAC grant, 404 no such Deployment, 409 changed meanwhile)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"Authorization": f"Bearer {self._token_now()}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
            data = json.dumps(body)
        async with self._session.request(method, self.api_url + path, data=data, headers=headers,
                                         ssl=self._ssl) as resp:
            text = await resp.text()
        try:
            decoded = json.loads(text) if text else None
        except ValueError:
            decoded = None
        if resp.status // 100 != 2:
            message = decoded.get("message") if isinstance(decoded, dict) else None
            hint = {401: " (the token is wrong or expired)",
                    403: " (the router's ServiceAccount lacks get/patch on deployments/scale: see compose/k8s)",
                    409: " (the Deployment changed meanwhile; the planner will retry)"}.get(resp.status, "")
            raise _unavailable(f"Kubernetes API answered {resp.status} {resp.reason} to {method} {where}"
                               f"{hint}: {message or text[:200]!r}")
        if not isinstance(decoded, dict):
            raise _unavailable(f"Kubernetes API answered {method} {where} with no JSON object: {text[:200]!r}")
        return decoded

    @staticmethod
    def _parse(scale: dict, where: str) -> tuple[int, str]:
        """(spec.replicas, metadata.resourceVersion) of an autoscaling/v1 Scale; replicas absent means 0."""
        replicas = (scale.get("spec") or {}).get("replicas", 0)
        if scale.get("kind") != "Scale" or isinstance(replicas, bool) or not isinstance(replicas, int):
            raise _unavailable(f"Kubernetes API answered {where} with no autoscaling/v1 Scale: {scale!r:.200}")
        return replicas, str((scale.get("metadata") or {}).get("resourceVersion", ""))


class LauncherScaler(Scaler):
    """``deepinfer up``'s processes: a ``ScaleRequest`` on ``subjects.launcher_scale()`` to the launcher, which
    starts a worker (or drains its newest one of the role) within its own bounds (``cli/launcher_scale.py``)
    and answers with the role's new count. No answer within ``timeout_s`` (no launcher: an external
    deployment): ``UNAVAILABLE``."""

    def __init__(self, nc, timeout_s: float = 5.0) -> None:
        self.nc, self.timeout_s = nc, timeout_s

    async def scale(self, role: str, delta: int) -> int:
        from shared import protocol, subjects
        order = protocol.ScaleRequest(role=role, delta=delta)   # INVALID_REQUEST for a bad role or delta
        try:
            reply = await self.nc.request(subjects.launcher_scale(), protocol.encode(order), timeout=self.timeout_s)
        except Exception as err:  # no responders, timeout, connection loss
            raise _unavailable(f"no launcher answered the scale request: {err!r}") from None
        return int(protocol.decode_reply(reply.data, protocol.Ack).detail)

    async def close(self) -> None:
        return None


def make_scaler(kind: str, *, timeout_s: float = 5.0, min_replicas: Mapping[str, int] | None = None,
                max_replicas: Mapping[str, int] | None = None, nc=None) -> Scaler | None:
    """The scaler ``--planner-scaler`` names: ``none`` -> None (the planner only switches roles),
    ``kubernetes`` -> ``KubernetesScaler.in_cluster`` (the pod's service account, Deployments ``prefill`` and
    ``decode`` of its own namespace), ``launcher`` -> ``LauncherScaler`` over ``nc`` (``deepinfer up``). Any other
    kind is ``INVALID_REQUEST``."""
    if kind == "none":
        return None
    if kind == "kubernetes":
        return KubernetesScaler.in_cluster(timeout_s=timeout_s, min_replicas=min_replicas, max_replicas=max_replicas)
    if kind == "launcher":
        return LauncherScaler(nc, timeout_s)
    raise invalid(f"no scaler of kind {kind!r} in services/router/scaler.py (known: none, kubernetes, launcher)")
