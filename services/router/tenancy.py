"""A tenant's cache namespace: the salt its requests run under (``tenant_salt``).

Invariant: the ``t/`` prefix belongs to authenticated tenants alone (their API key's or NATS subject's tenant);
a plain-API request that claims it is refused, so nobody can hit another tenant's cache.
"""
from __future__ import annotations

from shared import protocol
from shared.errors import invalid
from shared.wire_fields import MAX_ID_LEN

TENANT_SALT_PREFIX = "t/"


def tenant_salt(req: protocol.GenerateRequest, tenant: str | None) -> str:
    """The cache salt a request runs under. An authenticated tenant's requests are salted ``t/<tenant>`` (plus
    ``/<their own salt>``), so nobody else can hit that tenant's cache; the ``t/`` prefix is reserved, so a
    client cannot claim another tenant's salt through the plain API."""
    if req.cache_salt.startswith(TENANT_SALT_PREFIX):
        raise invalid(f"cache_salt: the prefix {TENANT_SALT_PREFIX!r} is reserved for authenticated tenants")
    if tenant is None:
        return req.cache_salt
    salt = TENANT_SALT_PREFIX + tenant + (f"/{req.cache_salt}" if req.cache_salt else "")
    if len(salt) > MAX_ID_LEN:
        raise invalid(f"cache_salt: longer than {MAX_ID_LEN - len(tenant) - 3} characters for this tenant")
    return salt
