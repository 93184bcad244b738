"""API keys of the router's HTTP API: each key names the tenant it authenticates.

Spec (``RouterConfig.api_keys`` / ``DEEPINFER_API_KEYS``): ``"key1=tenant1,key2=tenant2"``, or ``"@path"`` to a
file with one ``key=tenant`` per line (``#`` comments and blank lines allowed). Empty = no authentication.
Invariants: keys are compared in constant time; tenant names are valid subject tokens (the same tenants
are NATS users ``client-<tenant>`` publishing on ``di.v1.generate.<tenant>``); a key maps to one tenant.
"""
from __future__ import annotations

import hmac
from pathlib import Path

from shared import subjects


def parse_api_keys(spec: str) -> dict[str, str]:
    """``key -> tenant``; raises ``ValueError`` on a malformed entry (the router refuses to start)."""
    if not spec:
        return {}
    text = Path(spec[1:]).expanduser().read_text() if spec.startswith("@") else spec.replace(",", "\n")
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, tenant = line.partition("=")
        key, tenant = key.strip(), tenant.strip()
        if not sep or len(key) < 8 or not tenant:
            raise ValueError(f"api key entry {n}: expected key=tenant with a key of at least 8 characters")
        subjects.validate_token(tenant, "tenant")
        if key in keys:
            raise ValueError(f"api key entry {n}: the key is listed twice")
        keys[key] = tenant
    return keys


class ApiKeys:
    """``tenant_of(authorization_header)``: the tenant, or None when the header names no known key."""

    def __init__(self, spec: str) -> None:
        self._keys = [(k.encode(), t) for k, t in parse_api_keys(spec).items()]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def tenant_of(self, authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        given, found = token.strip().encode(), None
        for key, tenant in self._keys:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(key, given):
                found = tenant
        return found
